"""What a run checks once, in the driver, before it writes or starts anything.

`config.validate` checks the keys without touching files. `check` then opens what the run
will read: the workdir's own JSON files (a resume reads them), the corpus with every
learner's shard of it, and the fragment plan. A failure is a `FatalRunError` naming the file
or key, raised before the workdir is created and before any process or Ray actor starts:

    preflight.check(run, workdir)    # launch.run's first line, for every runtime

Inside actors the same errors can still arise (a data path missing on one node of a
cluster): `fatal_errors()` turns them into `FatalRunError`, which the Ray runtime answers by
stopping the run with the message instead of restarting the process (runtime/ray/).
"""

import contextlib
import json

from decoupled_diloco import paths, run_files
from decoupled_diloco.config import RunConfig

# Files of a workdir a re-run reads before it trains (runtime/launch.py, run_files.py).
WORKDIR_JSON = (run_files.RUN_CONFIG, run_files.CORPUS, "summary.json")
# Errors that come from the config or the data and so recur in every restarted process:
# ValueError (bad values, bad files), ImportError (a missing optional package),
# FileNotFoundError (a path this host does not have).
CONFIG_ERRORS = (ValueError, ImportError, FileNotFoundError)


class FatalRunError(Exception):
    """The run cannot go on and no restart would help (a bad config, corpus or fragment
    plan, an unreadable run file, a Ray cluster that would not start): stop with the
    message, which names the key or file."""


@contextlib.contextmanager
def fatal_errors(where: str = ""):
    """Inside the block, a config or data error (`CONFIG_ERRORS`) is a `FatalRunError`,
    prefixed with `where` (e.g. "learner 2")."""
    try:
        yield
    except FatalRunError:
        raise
    except CONFIG_ERRORS as e:
        raise FatalRunError(f"{where}: {_one_line(e)}" if where else _one_line(e)) from e


def check(run: RunConfig, workdir: str) -> None:
    """Raises `FatalRunError` when the run could not start or would fail in every process;
    reads, never writes."""
    check_filesystems(run, workdir)
    check_workdir_path(workdir)
    check_workdir_files(workdir)
    check_data(run)
    check_fragments(run)
    warn_of_placement(run)


def warn_of_placement(run: RunConfig) -> list[str]:
    """Warns (and returns the warnings) of devices no learner uses and of parameters a mesh
    axis leaves whole (`warn_of_whole_parameters`)."""
    warnings = warn_of_idle_devices(run)
    return warnings + warn_of_whole_parameters(run)


def warn_of_idle_devices(run: RunConfig) -> list[str]:
    """Local runtime: learners take disjoint groups of devices_per_learner devices (several
    learners to a group when there are more learners than groups); devices beyond
    learners x devices_per_learner train nothing."""
    import jax
    from absl import logging

    if run.runtime != "local":
        return []
    n, per, m = jax.device_count(), run.devices_per_learner, run.num_learners
    used = min(m, n // per) * per
    if used >= n:
        return []
    warning = (
        f"{n - used} of the {n} devices stay idle: {m} learner{'s' * (m != 1)} x "
        f"devices_per_learner={per} use {used} (set devices_per_learner, or diloco.learners, "
        "to use them all)"
    )
    logging.warning("%s", warning)
    return [warning]


# Share of the parameters a mesh axis would split that may stay whole on it unremarked (the
# MQA presets' single k/v head on a tensor axis: ~5% of gemma_2b's on 8).
WHOLE_SHARE_WARNED = 0.1


def warn_of_whole_parameters(run: RunConfig) -> list[str]:
    """Warns (and returns the warnings) of an fsdp or tensor axis that does not divide the
    dimensions it would split: those parameters are copied whole onto each of its devices
    (`sharding.logical_to_spec`), memory and compute an even split would not spend."""
    from absl import logging

    from decoupled_diloco import models, sharding

    shape = sharding.mesh_shape(run.mesh, run.devices_per_learner)
    params = models.param_shapes(run.model)
    report = sharding.whole_on_axes(params, models.param_logical_axes(run.model), shape)
    warnings = []
    for axis, (share, names) in report.items():
        if share > WHOLE_SHARE_WARNED:
            more = f", ... ({len(names)})" if len(names) > 4 else ""
            warnings.append(
                f"mesh.{axis}={shape[sharding.MESH_AXES.index(axis)]} does not divide the "
                f"dimensions it would split of {share:.0%} of those parameters "
                f"({', '.join(names[:4])}{more}): they are copied whole onto each of its "
                "devices; a size dividing the heads, kv heads, ffw width and vocabulary "
                "splits them"
            )
    for w in warnings:
        logging.warning("%s", w)
    return warnings


def check_filesystems(run: RunConfig, workdir: str) -> None:
    """Every remote path the run names (gs://...) must have its filesystem installed."""
    named = {
        "--workdir": workdir,
        "ray.checkpoint_dir": run.ray.checkpoint_dir,
        "data.spm_model_path": run.data.spm_model_path,
        "data.cache_dir": run.data.cache_dir,
        "data.tfds_data_dir": run.data.tfds_data_dir,
        "data.path": run.data.path,
    }
    with fatal_errors():
        for what, path in named.items():
            paths.check_reachable(path, what)


def check_workdir_path(workdir: str) -> None:
    """A local --workdir must be a folder this process may write, or one it may create."""
    import os

    if paths.is_remote(paths.resolve(workdir)):
        return
    path = os.path.abspath(os.path.expanduser(workdir))
    probe = path
    while not os.path.exists(probe):  # the deepest part of it that exists
        if os.path.islink(probe):  # (no folder can be made where a dangling link lies)
            raise FatalRunError(
                f"--workdir={workdir}: {probe} is a link to {os.readlink(probe)}, which does "
                "not exist (a disk not mounted?): make its target or give another folder"
            )
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == path else f"lies below a file ({probe})"
        raise FatalRunError(f"--workdir={workdir} {where}: give a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "" if probe == path else f" ({probe}, where it would be made)"
        raise FatalRunError(f"--workdir={workdir}{what} is not writable by this process")


def check_workdir_files(workdir: str) -> None:
    """Each JSON file of an existing workdir that a re-run reads must parse to an object."""
    for name in WORKDIR_JSON:
        path = paths.resolve(workdir) / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FatalRunError(
                f"{path} is unreadable or not JSON ({_one_line(e)}): repair or remove it, or "
                "use another --workdir"
            ) from e
        why = None if isinstance(value, dict) else f"a JSON {type(value).__name__}"
        if why is None and name == run_files.CORPUS:
            why = run_files.corpus_record_problem(value)
        if why is None and name == run_files.RUN_CONFIG:
            try:
                run_files.config_from_json(value)
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # (as read_config)
                why = f"not a run config ({_one_line(e)})"
        if why is not None:
            raise FatalRunError(
                f"{path} holds {why}: repair or remove it, or use another --workdir"
            )


def check_data(run: RunConfig) -> None:
    """Loads the corpus (cached: a local run's learners reuse it) and cuts every learner's
    training shard and the eval split, so an unreadable, binary, empty or too small corpus
    fails here. TFDS sources are opened, not read."""
    from decoupled_diloco.data import load_corpus, make_iterator

    cfg, batch, M = run.data, run.train.batch_size, run.num_learners
    with fatal_errors():
        corpus = load_corpus(cfg)
        for m in range(M):
            make_iterator(cfg, "train", batch, shard_index=m, num_shards=M)
        make_iterator(cfg, "eval", batch)
    warn_of_repeats(run, corpus.splits)


def warn_of_repeats(run: RunConfig, splits: dict) -> None:
    """Logs a warning when the run would read its train split more than once (every
    learner's steps together). In-memory splits only (`splits`: the corpus's; a TFDS split
    is opened, not counted). An evaluation reads at most the eval split once
    (train/evaluate.py says so when train.eval_batches asks for more)."""
    from absl import logging

    data, seq_len = splits["train"], run.data.seq_len
    if not hasattr(data, "dtype"):  # a TFDS record range
        return
    windows = max((len(data) - 1) // seq_len, 1)
    read = run.train.steps * run.train.batch_size * run.num_learners
    if read > windows:
        logging.warning(
            "the train split holds %d windows of data.seq_len=%d tokens and the run's steps "
            "read %d of them (%.1fx): windows repeat", windows, seq_len, read, read / windows,
        )  # fmt: skip


def check_fragments(run: RunConfig) -> None:
    """Builds the fragment plan every learner and syncer shard derives (abstract shapes
    only), so e.g. more fragments than parameter leaves fails here."""
    if not run.uses_syncer:
        return
    from decoupled_diloco.diloco.fragments import model_plan

    with fatal_errors():
        model_plan(run.model, run.diloco)


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def check_hosts(run: RunConfig, hosts: int) -> None:
    """What a learner (or a `distributed.*` world) spread over `hosts` hosts needs, each
    host reading only its own batch rows: the batch and the learner's devices split by
    host, and the batch mesh axes running across the hosts. The hosts are modelled as
    consecutive blocks of the learner's devices in mesh order (device k of the mesh on host
    k // (devices / hosts)), the order a slice lists them in; a learner checks the real
    placement again as it starts. ValueError naming the keys."""
    import numpy as np

    from decoupled_diloco import sharding, transfer
    from decoupled_diloco.data.pipeline import rows_per_host

    per, batch = run.devices_per_learner, run.train.batch_size
    if hosts < 1 or per % hosts:
        raise ValueError(
            f"devices_per_learner={per} cannot be split over {hosts} hosts: each host of a "
            "learner brings the same number of devices"
        )
    rows_per_host(batch, hosts, "train.batch_size")
    if hosts == 1:
        return
    shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(run.mesh, per), strict=True))
    axes = sharding.LOGICAL_RULES["batch"]
    ways = int(np.prod([shape[a] for a in axes]))
    position = np.indices([shape[a] for a in sharding.MESH_AXES]).reshape(len(shape), -1).T
    rows: dict[int, set] = {}
    for k, coords in enumerate(position):
        at = dict(zip(sharding.MESH_AXES, coords, strict=True))
        block = int(np.ravel_multi_index([at[a] for a in axes], [shape[a] for a in axes]))
        held = range(block * batch // ways, (block + 1) * batch // ways)
        rows.setdefault(k // (per // hosts), set()).update(held)
    transfer.check_rows_split_by_host(rows, batch, " (checked with hosts as consecutive devices)")
