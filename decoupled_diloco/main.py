"""Entry point: `python -m decoupled_diloco.main --config=configs/<file>.py --workdir=DIR`.

Any config key can be overridden: `--config.diloco.learners=4 --config.train.steps=100`
(every key is documented in decoupled_diloco/config.py). Restarting with the same --workdir
resumes the run from its checkpoints; a finished run is left as it is. Afterwards:
`python -m decoupled_diloco.evaluate|sample|export|report --workdir=DIR`.
"""

from decoupled_diloco import cli

cli.xla_flags()

import os  # noqa: E402
import sys  # noqa: E402

import ml_collections  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from decoupled_diloco import paths, profiling  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an ml_collections config file under configs/.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (metrics, checkpoints, summary).")
_FORCE = flags.DEFINE_bool(
    "force_resume",
    False,
    "Resume a workdir's run although config keys changed that change what it computes "
    "(the old config is kept as run_config.<attempt>.json).",
)
_CHECK = flags.DEFINE_bool(
    "check_config",
    False,
    "Check the config and its overrides as a run's start-up does, print the run's shape and "
    "exit: nothing is written (no --workdir needed), no data read, no JAX world or Ray "
    "cluster joined; the learners' meshes are checked against this process's devices "
    "(set XLA_FLAGS=--xla_force_host_platform_device_count=N to check for N).",
)
_CHECK_HOSTS = flags.DEFINE_integer(
    "check_hosts",
    1,
    "With --check_config: the hosts each learner spans (a multi-host TPU slice; a "
    "distributed.* world's processes), each reading its own batch rows: the batch, the "
    "devices and the batch mesh axes must split over them (scripts/tpu passes the slice's).",
    lower_bound=1,
)
_PROFILE = flags.DEFINE_string(
    "profile",
    "",
    "START:STOP: a jax.profiler trace of learner steps START..STOP-1 into <workdir>/profile "
    "(e.g. 10:13, after compilation); local runtime only. Empty: no trace.",
)


def main(argv) -> None:
    cli.refuse_stray_arguments(argv)  # e.g. config.train.steps=5, without its dashes
    if not flags.FLAGS["config"].present or not (_WORKDIR.value or _CHECK.value):
        sys.exit("usage: python -m decoupled_diloco.main --config=configs/<file>.py --workdir=DIR")
    path = config_flags.get_config_filename(flags.FLAGS["config"])
    if not os.path.isfile(path.split(":")[0]):
        sys.exit(f"error: config file {path} not found ({cli.MISSING_CONFIG})")
    config = _CONFIG.value
    if not isinstance(config, ml_collections.ConfigDict):
        sys.exit(f"error: {path}'s get_config() returned {type(config).__name__}, not an "
                 "ml_collections.ConfigDict (configs/*.py show the form)")  # fmt: skip
    cli.start(flags.FLAGS["verbosity"].present)
    if _CHECK.value:
        check_config(config)
        return
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.preflight import FatalRunError
    from decoupled_diloco.runtime import launch

    try:
        checked = config_lib.check_before_world(config)  # (a join waits for every host)
        join_world(config)
        run = config_lib.validate(config, checked=checked)
    except ValueError as e:
        sys.exit(f"config error: {e}")
    from decoupled_diloco.checkpoint import CorruptCheckpointError
    from decoupled_diloco.runtime.learner_loop import RunInterruptedError
    from decoupled_diloco.runtime.workdir import WorkdirBusyError

    _install_profiler(run)
    try:
        with cli.one_interrupt_per_press(_stop_signals()):
            summary = launch.run(run, _WORKDIR.value, force=_FORCE.value)
    except (FatalRunError, ValueError, WorkdirBusyError, launch.ModelNotFiniteError) as e:
        sys.exit(f"error: {e}")  # bad data or run files; a workdir of another run or in use
    except RunInterruptedError as e:
        saved = "learners and syncer" if run.uses_syncer else "the learners"
        print(f"{e}: {saved} saved; the same command resumes", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        # A second Ctrl-C (or one before training began): stop at once. Not through the
        # interpreter's shutdown: the run's threads may be inside XLA and orbax, and
        # finalizing under them aborted the process ("Fatal Python error: Aborted").
        print(
            "stopped at once: what the last checkpoints hold is kept; the same command "
            "resumes from there",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(130)
    except RuntimeError as e:
        corrupt = cli.cause(e, lambda x: isinstance(x, CorruptCheckpointError))
        if corrupt is not None:
            sys.exit(f"error: {corrupt}")
        oom = cli.out_of_memory(e)
        if oom is None:
            raise
        sys.exit(f"error: a learner ran out of device memory ({oom}). Lower train.batch_size, "
                 "raise train.microbatches, set model.remat=dots or full, compute a large "
                 "vocabulary's logits in chunks (model.logits_chunk=256), or give each learner "
                 "more devices (devices_per_learner), then run again (a run that took no "
                 "step starts over in its --workdir, one that did resumes with "
                 "--force_resume)")  # fmt: skip
    finally:
        profiling.close()
    if not summary.get("tokens"):
        print(
            "warning: no learner took a step: the global model is the initial one (the fault "
            "schedule (faults.*) had every learner out of the membership or down until the "
            "run ended)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    print(
        f"done: final_eval_loss={summary['final_eval_loss']:.4f} steps={summary['steps']} "
        f"tokens={summary['tokens']} wall={summary['wall_seconds']:.1f}s "
        f"merges={summary.get('merges', 0)} goodput={summary.get('goodput', 0):.3f} "
        f"-> {_WORKDIR.value}/summary.json",
        flush=True,
    )


def check_config(config) -> None:
    """`--check_config`: validation without running; exits 1 with the error."""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.preflight import (
        FatalRunError,
        check_fragments,
        check_hosts,
        warn_of_placement,
    )

    try:
        run = config_lib.validate(config, require_packages=False)
        check_fragments(run)  # the plan needs no data: a run's start-up would refuse it
        check_hosts(run, _CHECK_HOSTS.value)  # what a learner on its slice would refuse
        if _PROFILE.value:
            profiling.check_steps(_PROFILE.value, run)
    except (ValueError, FatalRunError) as e:
        sys.exit(f"config error: {e}")
    print(f"config ok: {shape(run, config.model.preset)}", flush=True)
    warn_of_placement(run)  # (logged)


def shape(run, preset: str) -> str:
    """One line: who trains what, on which meshes, synced how."""
    from decoupled_diloco import models, sharding

    mesh = sharding.mesh_shape(run.mesh, run.devices_per_learner)
    axes = ", ".join(f"{a} {n}" for a, n in zip(sharding.MESH_AXES, mesh, strict=True) if n > 1)
    d, t = run.diloco, run.train
    learners = f"{d.learners} learner{'s' * (d.learners != 1)}"
    sync = (
        f"H {d.sync_every}, P {d.fragments}, tau {d.overlap}, K {d.quorum}"
        if d.uses_syncer
        else "no syncer (data-parallel)"
    )
    return (
        f"{run.name}: {run.runtime} runtime, {learners} x {run.devices_per_learner} "
        f"device{'s' * (run.devices_per_learner != 1)} "
        f"(mesh {axes or 'one device'}), model {preset} "
        f"{models.count_params(run.model) / 1e6:.1f}M params, {t.steps} steps x "
        f"{t.batch_size} x {run.data.seq_len} tokens per learner; {sync}"
    )


def _install_profiler(run) -> None:
    if not _PROFILE.value:
        return
    try:
        start, stop = profiling.check_steps(_PROFILE.value, run)
    except ValueError as e:
        sys.exit(f"error: {e}")
    # Where the run writes (paths.resolve: "~" expanded, as launch.run does; the shell leaves
    # the "~" of --workdir=~/x alone).
    directory = str(paths.resolve(_WORKDIR.value) / "profile")
    profiling.install(profiling.StepProfiler(directory, start, stop))


def _stop_signals() -> tuple:
    """The signals that stop the run in order (cli.one_interrupt_per_press). Not SIGTERM in
    a `distributed.*` world: its processes would each stop after a step of their own (none
    agrees with the others when to stop), and the one whose next step needs the others
    would wait for them for ever; a `pkill` of every host ends the world as it always did,
    losing what the last checkpoint does not hold."""
    import signal

    import jax

    return cli.STOP_SIGNALS if jax.process_count() == 1 else (signal.SIGINT,)


def join_world(config) -> None:
    """Joins the JAX world of `distributed.*` (a multi-host data-parallel run; nothing for
    one process), before validation starts JAX's backend. ValueError: a bad section."""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco import jax_world

    dist = config_lib.distributed_config(config)
    jax_world.initialize(dist.world(), dist.initialization_timeout)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
