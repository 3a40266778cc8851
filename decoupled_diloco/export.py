"""A run's global model as a standalone directory: `python -m decoupled_diloco.export`.

    python -m decoupled_diloco.export --workdir=/tmp/dd_dec --out=/tmp/dd_dec_model
    python -m decoupled_diloco.sample --workdir=/tmp/dd_dec_model --prompt="def "

The directory holds the parameters as an orbax checkpoint (`params/`, flat float32 arrays
keyed by leaf name), the run's config (`run_config.json`, whose `model` section is the
architecture), its tokenizer (`tokenizer.model` for sentencepiece runs) and `export.json`
(where the parameters came from). `decoupled_diloco.load` reads it without the run's other
files; so do `evaluate` and `sample`.
"""

from decoupled_diloco import cli

cli.xla_flags()

import json  # noqa: E402
import sys  # noqa: E402

from absl import flags  # noqa: E402


def export(workdir: str, out: str, step: int | None = None) -> str:
    """Writes the model of `workdir` into `out`; returns where the parameters came from."""
    import orbax.checkpoint as ocp

    from decoupled_diloco import integrity, paths, run_files
    from decoupled_diloco.loading import EXPORT_MARKER, PARAMS, load

    root = paths.resolve(out)  # absolute: orbax refuses a relative checkpoint path
    if root.exists() and not root.is_dir():
        raise ValueError(f"--out={out} is a file: choose a new folder")
    if root.exists() and any(root.iterdir()):  # a run's workdir, an export, anything else
        held = sorted(p.name for p in root.iterdir())[:4]
        raise ValueError(f"{out} is not empty (it holds {', '.join(held)}): choose a new --out")
    made = not root.exists()
    try:  # before the load (minutes for a large model): a path that cannot be a folder
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission
        raise ValueError(f"--out={out} cannot be made a folder: {e.strerror or e}") from e
    try:
        model = load(workdir, step)
    except BaseException:
        if made:
            root.rmdir()  # (empty: nothing was written yet)
        raise
    run_files.write(out, model.config, model.tokenizer)
    manager = ocp.CheckpointManager(root / PARAMS)
    manager.save(
        0,
        args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(model.params),
            meta=ocp.args.JsonSave(integrity.seal(model.params, {"source": model.source})),
        ),
    )
    manager.wait_until_finished()
    manager.close()
    # The learner step the parameters hold (not the --step asked for: the newest save at or
    # before it), so `load(export, step)` can say whether the export is at or before `step`.
    # (the workdir resolved: a relative one means nothing read from elsewhere)
    where = f"{paths.resolve(workdir)}: {model.source}"
    info = {"source": where, "step": model.step, "leaves": len(model.params)}
    (root / EXPORT_MARKER).write_text(json.dumps(info, indent=1))
    return model.source


def main(argv) -> None:
    cli.refuse_stray_arguments(argv)
    FLAGS = flags.FLAGS
    if not FLAGS.workdir or not FLAGS.out:
        sys.exit("usage: python -m decoupled_diloco.export --workdir=DIR --out=PATH [--step=N]")
    cli.start(flags.FLAGS["verbosity"].present)
    from decoupled_diloco.checkpoint import CorruptCheckpointError

    try:
        source = export(FLAGS.workdir, FLAGS.out, FLAGS.step)
    except (FileNotFoundError, ValueError, CorruptCheckpointError) as e:
        sys.exit(f"error: {e}")
    print(f"exported {source} -> {FLAGS.out}", flush=True)


def _define_flags() -> None:
    flags.DEFINE_string("workdir", None, "The run's workdir.")
    flags.DEFINE_string("out", None, "The model directory to write (local or gs://).")
    flags.DEFINE_integer("step", None, "The newest checkpoint at or before this step.")


if __name__ == "__main__":
    cli.run(main, _define_flags)
