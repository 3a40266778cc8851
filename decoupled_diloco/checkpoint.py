"""orbax checkpoints of learners and the syncer.

Layout under `<workdir>/checkpoints/`: `learner_<m>/<step>/` holds a learner's TrainState
(parameters, AdamW state, step), its data-iterator position and incarnation; its DiLoCo
bookkeeping is not saved: a learner restarting against a syncer starts from the syncer's
snapshot (its parameters, counters at zero), keeping only its step, data position and, in a
resumed run, its AdamW state. `syncer_<s>/<n>/` holds shard s's Θ, outer
momenta, versions, schedule slots and vector clocks, plus the fragment plan, the learner
registry, its counters and its event-log position, written one fragment at a time
(fragment_checkpoint.py). Restores go straight onto the target shardings.

Trust no byte: every save writes the checksums of its arrays and of its side-car into the
side-car (integrity.py), and every restore verifies them and that the values are finite. A
step that fails (or cannot be read at all) is reported, moved aside to
`<checkpoints>/corrupt/<name>-<step>` (kept for inspection, out of the manager's sight) and
the previous kept step is tried; when no kept step is good the restore raises
`CorruptCheckpointError` naming every directory and why it was refused.
"""

import json
import logging
import re
import sys
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from decoupled_diloco import integrity, paths

# Saves are synchronous: orbax's asynchronous saves from several threads of one process
# (learners of the local runtime) fail or deadlock (measured with orbax-checkpoint 0.12.8:
# "Directory not empty", timeouts waiting for step-directory signals), while synchronous
# saves of separate managers from separate threads are safe, so they need no shared lock
# and one learner's save never stalls another learner or the syncer. A manager is used by
# one thread at a time (its owner), guarded by its own lock.


class CorruptCheckpointError(RuntimeError):
    """No kept step of a checkpoint directory could be verified."""


class CheckpointSaveError(OSError):
    """A step could not be written; nothing of it is kept."""


# How TensorStore and XLA prefix an error: its absl status code.
_STATUS_CODE = re.compile(r"^[A-Z_]+: ")


_QUIET = False  # quiet_failed_read_leftovers has run


def quiet_failed_read_leftovers() -> None:
    """Keeps a failed orbax read to the one line its caller reports (installed before reads,
    once per process). When one array cannot be read orbax closes its event loop while
    TensorStore still holds callbacks for the other arrays, and abandons their tasks: the
    callbacks land as unraisable "Event loop is closed" RuntimeErrors, the read coroutines as
    unraisable errors of their own when collected, and the tasks (and the
    futures gathering them) as asyncio's "... exception was never retrieved" errors, tens to
    ~1500 tracebacks on stderr (measured with orbax-checkpoint 0.12.8). Those, from orbax,
    are dropped; anything else goes where it went before."""
    global _QUIET
    if _QUIET:
        return
    _QUIET = True
    previous = sys.unraisablehook

    def hook(unraisable):
        e = unraisable.exc_value
        closed = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        # An abandoned read coroutine of orbax's, closed when collected (a restore into
        # another model's shapes leaves tens of them).
        code = getattr(unraisable.object, "cr_code", None)
        abandoned = code is not None and "/orbax/" in code.co_filename
        if not (closed or abandoned):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_abandoned_orbax_tasks)


def _abandoned_orbax_tasks(record: logging.LogRecord) -> bool:
    """False for asyncio's report of an abandoned orbax task or future: the task's repr
    names orbax's coroutine, a future's (a `gather` of reads) only its exception, whose
    traceback runs through orbax, or, a TensorStore read's own future, is TensorStore's
    error (a status code, then the driver that failed: no traceback to tell by)."""
    message = record.getMessage()
    if "exception was never retrieved" not in message.split("\n", 1)[0]:
        return True
    e = record.exc_info[1] if record.exc_info else None
    tensorstore = e is not None and bool(_TENSORSTORE_ERROR.match(str(e)))
    return not ("/orbax/" in message or tensorstore or _raised_in_orbax(record.exc_info))


# How TensorStore words a failed read: an absl status code, then the driver it failed in.
_TENSORSTORE_ERROR = re.compile(r'[A-Z_]+: Error (opening|reading|writing) "\w+" driver')


def _raised_in_orbax(exc_info) -> bool:
    e = exc_info[1] if exc_info else None
    while e is not None:
        tb = e.__traceback__
        while tb is not None:
            if "/orbax/" in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return False


class Checkpointer:
    """One orbax CheckpointManager: an array tree plus a JSON side-car per step."""

    def __init__(self, directory: "str | epath.Path", max_to_keep: int = 2):
        self._lock = threading.Lock()
        # Remote paths (gs://..., for multi-node Ray runs) go to orbax as they are.
        self.directory = paths.resolve(directory)
        # Steps refused on restore since the owner last looked: (step, reason, moved to;
        # None: it could not be moved).
        self.refused: list[tuple[int, str, str | None]] = []
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, arrays: Any, meta: dict, wait: bool = True) -> bool:
        """False (and logged) when the arrays are not finite: such a state is not saved.
        Raises CheckpointSaveError when the step cannot be written (nothing of it kept)."""
        del wait  # saves are synchronous (see the note at the top of this module)
        try:
            meta = integrity.seal(arrays, meta)
        except ValueError as e:
            logging.error("%s: step %d not saved: %s", self.directory, step, e)
            return False
        with self._lock:
            try:
                self.manager.save(
                    step,
                    args=ocp.args.Composite(
                        arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
                    ),
                    force=True,
                )
                self.manager.wait_until_finished()
            except Exception as e:
                raise self._save_failed(step, e) from None
        return True

    def _save_failed(self, step: int, e: Exception) -> "CheckpointSaveError":
        """The error a failed save (a full disk, a folder it may not write) raises: the
        step never committed, so the latest step is still the one before."""
        # A full disk reaches us as TensorStore's `RESOURCE_EXHAUSTED: Failed writing ...`,
        # which the entry points (cli.out_of_memory) read as device memory running out and
        # answer with batch-size advice; the status code goes, the cause is not chained.
        what = _STATUS_CODE.sub("", str(e).split("\n", 1)[0])
        if len(what) > 500:  # the OS's reason ("No space left on device") comes last
            what = f"{what[:150]} ... {what[-300:]}"
        # The half-written step's folder (orbax's `<step>.orbax-checkpoint-tmp*`) holds
        # disk a retry needs; orbax replaces it only when the same step is saved again.
        for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            try:
                tmp.rmtree()
            except OSError as err:
                logging.error("could not delete the half-written %s: %s", tmp, err)
        return CheckpointSaveError(
            f"{self.directory}: saving step {step} failed ({type(e).__name__}: {what}); the "
            f"latest saved step is still {self.manager.latest_step()}: if the disk is full or "
            "the folder not writable, fix that, then resume (the same command)"
        )

    def restore(self, abstract_arrays: Any, step: int | None = None) -> tuple[Any, dict]:
        """The newest verified step (at or before `step`): (arrays, side-car).
        `abstract_arrays`: a tree of ShapeDtypeStruct (with .sharding) or numpy arrays."""

        def read(s):
            restored = self.manager.restore(
                s,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardRestore(abstract_arrays), meta=ocp.args.JsonRestore()
                ),
            )
            arrays, meta = restored["arrays"], restored["meta"]
            return (arrays, meta), integrity.check(arrays, meta)

        return self._first_good(read, step)

    def restore_meta(self, step: int | None = None) -> dict:
        """The side-car JSON alone of the newest step whose side-car verifies."""

        def read(s):
            meta = self.manager.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return meta.meta, integrity.check_meta(meta.meta)

        return self._first_good(read, step)

    def _first_good(self, read, step: int | None):
        quiet_failed_read_leftovers()
        with self._lock:
            steps = sorted(self.manager.all_steps(), reverse=True)
            candidates = [s for s in steps if step is None or s <= step]
            if not candidates:
                raise FileNotFoundError(f"{self.directory}: no checkpoint at or before {step}")
            refused = []
            for s in candidates:
                try:
                    out, reason = read(s)
                except Exception as e:  # unreadable files are a refused step, like bad bytes
                    out, reason = None, f"unreadable ({type(e).__name__}: {str(e)[:200]})"
                if not reason:
                    for bad, why in refused:  # newer than the one used: out of the way
                        self._set_aside(bad, why)
                    return out
                refused.append((s, reason))
        # None verifies: all stay, so a retry fails alike instead of starting afresh.
        raise CorruptCheckpointError("no kept checkpoint step can be trusted: " + "; ".join(
            f"{self.directory}/{s}: {why}" for s, why in refused) + ". Put a good copy of "
            "one of these step folders in its place (from a backup), then run the same "
            "command again")  # fmt: skip

    def _set_aside(self, step: int, reason: str) -> None:
        moved = set_aside(self.directory / str(step), reason)
        if moved is None:  # left in place it would stay the latest step (a later save of
            try:  # that step skipped as done) and count for max_to_keep, pruning good ones
                (self.directory / str(step)).rmtree()
                logging.error("checkpoint %s/%d deleted instead", self.directory, step)
            except OSError as e:
                logging.error("could not delete %s/%d either: %s", self.directory, step, e)
        self.manager.reload()
        self.refused.append((step, reason, moved))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def set_aside(src: epath.Path, reason: str) -> str | None:
    """Moves a refused step directory `<checkpoints>/<name>/<step>` out of its manager's
    sight to `<checkpoints>/corrupt/<name>-<step>` (kept for inspection); returns where, or
    None when it could not be moved (it stays, refused again at every restore)."""
    dst = src.parent.parent / "corrupt" / f"{src.parent.name}-{src.name}"
    if dst.exists():
        dst = dst.with_name(f"{dst.name}-{int(time.time())}")
    logging.error("checkpoint %s refused (%s); moving it to %s", src, reason, dst)
    try:
        paths.move_tree(src, dst)  # on GCS object by object: no folders, no renames
    except OSError as e:  # a read-only copy: leave it, but never use it
        logging.error("could not move %s aside (%s): it stays where it is", src, e)
        return None
    return str(dst)


def save_learner(ckpt: Checkpointer, state, data_state: dict, step: int, incarnation: int) -> None:
    """A learner's TrainState with its step, data position and incarnation (a no-op while
    it is down, or when this step is saved already)."""
    if state is None or ckpt.latest_step() == step:
        return
    host, hosts = _process()
    if hosts > 1:  # before the step commits: a committed step always has every host's
        _save_host_data(ckpt, step, data_state, host)
    ckpt.save(step, state, {"step": step, "data": data_state, "incarnation": incarnation})
    if hosts > 1:
        _drop_host_data(ckpt, step, host)


def _process() -> tuple[int, int]:
    """(this process, processes) of the learner's JAX world (a multi-host learner's slice)."""
    return jax.process_index(), jax.process_count()


def _host_data(ckpt: Checkpointer) -> epath.Path:
    """Data positions of each host of a multi-host learner, `<name>.hosts/<step>/<h>.json`:
    host h reads its own rows (data/pipeline.py), so its position is its own, while the
    side-car JSON is written by process 0 alone."""
    directory = epath.Path(ckpt.directory)
    return directory.parent / f"{directory.name}.hosts"


def _save_host_data(ckpt: Checkpointer, step: int, data_state: dict, host: int) -> None:
    """Host `host`'s position at `step`, whole or not at all (written before the step's
    checkpoint commits: a kill between the two left a committed step without it, which
    the resume refused as another topology's)."""
    folder = _host_data(ckpt) / str(step)
    folder.mkdir(parents=True, exist_ok=True)
    paths.write_atomic(folder / f"{host}.json", json.dumps(data_state))


def _drop_host_data(ckpt: Checkpointer, step: int, host: int) -> None:
    """Host `host`'s positions of the steps the checkpointer no longer keeps (and of saves
    that never committed)."""
    kept = {str(s) for s in ckpt.manager.all_steps()} | {str(step)}
    for old in _host_data(ckpt).iterdir():  # each host drops its own of the dropped steps
        if old.name not in kept and (old / f"{host}.json").exists():
            (old / f"{host}.json").unlink()


def _restore_host_data(ckpt: Checkpointer, step: int, host: int) -> dict:
    path = _host_data(ckpt) / str(step) / f"{host}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no data position of host {host} at step {step}")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:  # written atomically, so damaged after the fact
        raise ValueError(
            f"{path}: the data position of host {host} at step {step} does not parse ({e}); "
            "the step's checkpoint cannot be resumed without it: restore it from a copy, or "
            "move the step aside to resume the one before"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: the data position of host {host} at step {step} is a "
            f"{type(data).__name__}, not a JSON object"
        )
    return data


def restore_learner(ckpt: Checkpointer, abstract_state, params_too: bool):
    """(step, data position, next incarnation, TrainState or None) of the last checkpoint,
    or None without one. Without `params_too` only the position is read: a learner restarting
    against a syncer takes its parameters from Θ."""
    ckpt.manager.wait_until_finished()
    if ckpt.latest_step() is None:
        return None
    if params_too:
        state, meta = ckpt.restore(abstract_state)
    else:
        state, meta = None, ckpt.restore_meta()
    data, (host, hosts) = meta["data"], _process()
    if hosts > 1:
        try:
            data = _restore_host_data(ckpt, int(meta["step"]), host)
        except FileNotFoundError as e:  # each host's position is its own sub-shard's
            saved = data.get("num_hosts", 1)
            raise ValueError(
                f"{e}: the learner checkpoint was written by {saved} host(s) and this learner "
                f"spans {hosts}; its hosts' data positions cannot be carried over: resume it "
                "on a slice of the same topology"
            ) from None
    return int(meta["step"]), data, int(meta["incarnation"]) + 1, state


def _counted_path(ckpt: Checkpointer) -> epath.Path:
    """`<checkpoints>/counted/learner_<m>.json` (not a `learner_*` entry of its own, which
    tools take for a learner's checkpoint folder)."""
    directory = epath.Path(ckpt.directory)
    return directory.parent / "counted" / f"{directory.name}.json"


def save_counted(ckpt: Checkpointer, counted: dict) -> None:
    """A learner's steps counted lost so far, {fragment: [(lo, hi], ...]}
    (runtime/learner_loop.py `_cut`), beside its checkpoints. Written whenever they change,
    not with a checkpoint: a crash counted after the last checkpoint stays counted when a
    resume goes back to it."""
    text = json.dumps({str(p): [list(s) for s in spans] for p, spans in counted.items()})
    path = _counted_path(ckpt)
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.write_atomic(path, text)


def load_counted(ckpt: Checkpointer) -> dict[int, list[tuple[int, int]]]:
    """What `save_counted` wrote ({} if nothing, or if the file does not read as one: it
    only keeps a resume from counting lost steps twice)."""
    path = _counted_path(ckpt)
    try:
        raw = json.loads(path.read_text()) if path.exists() else {}
        return {int(p): [(int(a), int(b)) for a, b in spans] for p, spans in raw.items()}
    except (ValueError, TypeError, AttributeError) as e:
        logging.warning("%s does not read (%s): the steps counted lost before may be counted "
                        "again", path, e)  # fmt: skip
        return {}
