"""One run per workdir: its lock, the config a resume must keep, and the run's attempts.

  <workdir>/run.lock         held while a process runs the run (who holds it: inside)
  <workdir>/attempts.jsonl   one line per process that ran it: when it started, its own
                             wall time and failure counters (kept current while it runs)

A local workdir is locked with `fcntl.flock`, which the kernel releases when the process
dies however it dies; a remote one (gs://...) with a renewed lease that a dead process's
successor takes over (runtime/workdir_lock.py).

A resume must run the config the workdir's run started with (run_config.json); only keys that
change how a run is observed or placed, not what it computes (`FREE_TO_CHANGE`), may differ,
and where its corpus lies (`FREE_WITH_CORPUS_RECORD`) once corpus.json says what it holds.
`force=True` (`--force_resume`) accepts any change: it is recorded in attempts.jsonl and the
previous config is kept as run_config.<attempt>.json.
"""

import json
import os
import socket
import threading
import time

from etils import epath

from decoupled_diloco import fault_steps, paths, run_files
from decoupled_diloco.config import RunConfig
from decoupled_diloco.metrics import read_jsonl
from decoupled_diloco.runtime.workdir_lock import LOCK, WorkdirBusyError, lock

__all__ = ["LOCK", "WorkdirBusyError", "lock"]  # the lock lives in workdir_lock.py

ATTEMPTS = "attempts.jsonl"
FREE_TO_CHANGE = frozenset(
    {
        "name",
        # Memory and speed knobs: the same math to float tolerance (an OOM run may resume
        # with remat or microbatches).
        "model.remat",
        "model.attention_impl",
        "model.logits_chunk",
        "model.logits_gather",
        "train.microbatches",
        # Where a learner's computation is placed: its batch and math are the same on any
        # mesh (to float tolerance), and its checkpoint restores onto the new shardings (an
        # OOM run may resume sharded FSDP or tensor-parallel).
        "mesh.data",
        "mesh.fsdp",
        "mesh.tensor",
        "mesh.expert",
        "devices_per_learner",
        "train.eval_every",
        "train.eval_batches",
        "train.log_every",
        "train.checkpoint_every",
        "train.checkpoint_duty",
        "train.tensorboard",
        "train.prefetch",
        "train.metrics_lag",
        "gil_switch_ms",  # (how often Python threads switch: speed, not math)
        "local_syncer",  # (the syncer in a thread or a process: one checkpoint format)
        "diloco.stage_merges",
        "diloco.device_rebase",
        "diloco.merge_threads",
        "diloco.reply_spares",
        "ray.address",
        "ray.max_restarts",
        "ray.num_cpus",
        "ray.temp_dir",
        "ray.poll_seconds",
        "ray.evaluate",
        "ray.max_same_failures",
        "distributed.coordinator_address",  # host 0's address: a replaced VM has a new one
        "distributed.initialization_timeout",
    }
)
# Where the corpus and tokenizer cache lie: free to change once the workdir records what its
# corpus holds (run_files.CORPUS), which a resume then compares instead (the same files
# copied elsewhere, or the path typed another way, resume; other contents do not).
FREE_WITH_CORPUS_RECORD = frozenset({"data.path", "data.tfds_data_dir", "data.cache_dir"})
# Counters a resumed run adds up over its attempts (each process counts its own).
ACCUMULATED = ("wall_seconds", "failures", "restarts", "resume_lost_steps", "crash_lost_steps",
               "syncer_lost_steps", "rejected_offers", "dropped_offers",
               "bytes_communicated")  # fmt: skip


def config_changes(workdir: str, cfg: RunConfig) -> list[str]:
    """The `section.key`s in which `cfg` differs from the config the workdir's run started
    with ([] for a new workdir)."""
    if not (epath.Path(workdir) / run_files.RUN_CONFIG).exists():
        return []
    saved = run_files.config_to_json(run_files.read_config(workdir))
    now = run_files.config_to_json(run_files.recorded(cfg))
    changed = []
    for section in sorted(set(saved) | set(now)):
        a, b = saved.get(section), now.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += [f"{section}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changed.append(section)
    return changed


def trained(workdir: str, cfg: RunConfig, checkpoints: str | None = None) -> bool:
    """Whether the workdir's run has taken a step: a metrics row, or anything saved in its
    checkpoint directories (`_checkpoint_dirs`) besides the learners' incarnation counters.
    A run that failed before its first step (out of memory at compilation, a typo found by
    the first batch) has not."""
    root = epath.Path(workdir)
    metrics = root / "metrics.jsonl"
    if metrics.exists() and metrics.stat().length > 0:
        return True
    for d in _checkpoint_dirs(workdir, cfg, checkpoints):
        saved = [c for c in d.iterdir() if c.name != "lives"] if d.exists() else []
        if any(not c.is_dir() or any(c.iterdir()) for c in saved):
            return True
    return False


def check_resume(
    workdir: str,
    cfg: RunConfig,
    finished: bool,
    force: bool,
    stepped: bool | None = None,
    checkpoints: str | None = None,
) -> list[str]:
    """Refuses a config the workdir's run cannot continue with; returns the changes that are
    accepted (free ones, or any with `force`, or any when the run has not `trained`: it
    starts over with them). `stepped`: `trained(...)` when the caller has it; `checkpoints`:
    the learners' checkpoint directory (default `<workdir>/checkpoints`)."""
    root = epath.Path(workdir)
    if stepped is None:
        stepped = trained(workdir, cfg)
    if stepped and not (root / run_files.RUN_CONFIG).exists() and not force:
        # Without it a resume would take any config on trust.
        raise ValueError(
            f"{workdir} holds a run that trained (metrics, checkpoints) but no "
            f"{run_files.RUN_CONFIG}: the config it started with cannot be compared; put the "
            "file back, use another --workdir, or pass --force_resume to continue it with "
            "this config"
        )
    changed = config_changes(workdir, cfg)
    if not stepped and not finished:  # nothing to continue: the new values start it over
        return changed
    free = FREE_TO_CHANGE
    if (epath.Path(workdir) / run_files.CORPUS).exists():
        free |= FREE_WITH_CORPUS_RECORD
    binding = [k for k in changed if k not in free]
    # A finished run is only read back: knobs free to change (memory, logging; a preset's
    # new default for one) leave its summary what it was.
    if finished and binding:
        raise ValueError(
            f"{workdir} holds a finished run with another config (differs in "
            f"{_listed(binding)}): use another --workdir for a new run"
        )
    if binding and not force:
        raise ValueError(
            f"{workdir} holds a run with another config (differs in {_listed(binding)}): "
            "resume it with its own config, use another --workdir, or pass --force_resume to "
            "continue it with the new values"
        )
    reshaped = _reshaped(workdir, cfg) if any(k.startswith("model.") for k in binding) else []
    if reshaped:  # checked before anything is written: the run's own command still resumes
        raise ValueError(
            f"{workdir} holds a run whose parameters the new model.* values reshape "
            f"({_listed(reshaped)}): no checkpoint of it can be restored, even with "
            "--force_resume; use another --workdir for the new model"
        )
    if "train.steps" in binding:
        saved = _checkpointed_step(workdir, cfg, checkpoints)
        if saved is not None and saved[1] > cfg.train.steps:
            raise ValueError(
                f"{workdir} holds learner checkpoints past the new train.steps="
                f"{cfg.train.steps} (learner {saved[0]} at step {saved[1]}), even with "
                "--force_resume: a learner resumed there is past the run's end (the syncer "
                "refuses its steps); raise train.steps to at least that, or use another "
                "--workdir"
            )
    relaid = (
        _syncer_relaid(workdir, cfg)
        if any(k.startswith(("diloco.", "model.")) for k in binding)
        else []
    )
    if relaid:
        raise ValueError(
            f"{workdir} holds a run whose syncer checkpoints the new values lay out otherwise "
            f"({', '.join(relaid)}): each syncer shard restores its own fragments from its own "
            "checkpoint, laid out for the run's values, even with --force_resume; resume "
            "with the run's values or use another --workdir"
        )
    return changed


def _checkpoint_dirs(workdir: str, cfg: RunConfig, checkpoints: str | None) -> list:
    """Where the workdir's run may have saved: `checkpoints` (default
    `<workdir>/checkpoints`) and the `ray.checkpoint_dir` of `cfg` and of the run's own
    config where that one is a Ray run's (the local runtime reads no ray.* key)."""
    runs = [cfg]
    if (epath.Path(workdir) / run_files.RUN_CONFIG).exists():
        runs.append(run_files.read_config(workdir))
    dirs = {checkpoints or str(epath.Path(workdir) / "checkpoints")}
    dirs |= {r.ray.checkpoint_dir for r in runs if r.runtime == "ray" and r.ray.checkpoint_dir}
    return [paths.resolve(d) for d in sorted(dirs)]


def _checkpointed_step(workdir: str, cfg: RunConfig, checkpoints: str | None):
    """(learner, step) of the highest step a learner checkpoint holds (its step folders'
    names, `learner_<m>/<step>`), None if none; where `trained` looks."""
    best = None
    for d in _checkpoint_dirs(workdir, cfg, checkpoints):
        for learner in d.glob("learner_*") if d.exists() else ():
            m = learner.name.removeprefix("learner_")
            steps = [int(c.name) for c in learner.iterdir() if c.name.isdigit()]
            if m.isdigit() and steps and (best is None or max(steps) > best[1]):
                best = (int(m), max(steps))
    return best


def _syncer_relaid(workdir: str, cfg: RunConfig) -> list[str]:
    """How the syncer checkpoints of the workdir's run would not fit `cfg`'s syncer: another
    fragment plan (fragments, strategy, sync_every, embedding split) or shard count."""
    from decoupled_diloco.diloco.fragments import model_plan

    then = run_files.read_config(workdir)
    if not (then.uses_syncer and cfg.uses_syncer):
        return []
    out = []
    if model_plan(then.model, then.diloco) != model_plan(cfg.model, cfg.diloco):
        out.append("the fragment plan")
    shards = (then.diloco.syncer_shards, cfg.diloco.syncer_shards)
    if shards[0] != shards[1]:
        out.append(f"diloco.syncer_shards {shards[0]} -> {shards[1]}")
    return out


def _reshaped(workdir: str, cfg: RunConfig) -> list[str]:
    """Parameters whose shape differs between the workdir's run's model and `cfg`'s (or
    that only one of them has)."""

    from decoupled_diloco import models

    def shapes(model_cfg) -> dict:
        tree = models.param_shapes(model_cfg)
        return {k: v.shape for k, v in models.flatten_params(tree).items()}

    then, now = shapes(run_files.read_config(workdir).model), shapes(cfg.model)
    return sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k))


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "")


def counters_of(ledger, bytes_communicated=None):
    """What an attempt's heartbeat records of a run's ledger (`Attempt.watch`): every
    counter summed over attempts (`ACCUMULATED`; wall time is the attempt's own clock), so
    a killed attempt's failures, lost steps and traffic count in the run's summary.
    `bytes_communicated()`: the attempt's syncer traffic so far (None: a runtime without it;
    a syncer in a process of its own reports it at the attempt's end)."""
    kept = [k for k in ACCUMULATED if k not in ("wall_seconds", "bytes_communicated")]

    def counters() -> dict:
        out = {k: getattr(ledger, k) for k in kept}
        if bytes_communicated is not None:
            out["bytes_communicated"] = bytes_communicated()
        return out

    return counters


def previous_attempts(workdir: str) -> list[dict]:
    return read_jsonl(epath.Path(workdir) / ATTEMPTS)


class Attempt:
    """This process's attempt at the run. While it runs, a daemon thread rewrites
    attempts.jsonl's last line every `every` seconds with its counters so far, so an attempt
    that is killed still leaves its wall time and failures (to within `every`).

    It also records where the run stands on its fault timeline (`fault_clock`: the seconds
    every attempt has trained so far); `fault_offset` is the last such reading of the earlier
    attempts, where this attempt's faults in seconds continue from instead of replaying
    (a killed attempt's reading is its last heartbeat's, up to `every` seconds short). A
    schedule in steps is recorded the same way (`fault_steps`: the step up to which each
    learner, and the run's lead, checked it); `fault_steps_checked` merges the earlier
    attempts' (fault_steps.py)."""

    def __init__(self, workdir: str, changed: list[str], forced: bool, every: float = 5.0):
        self.workdir, self.every = workdir, every
        self.records = previous_attempts(workdir)
        self.number = len(self.records)
        self.fault_offset = max((r.get("fault_clock", 0.0) for r in self.records), default=0.0)
        self.fault_clock = lambda: self.fault_offset
        self.fault_steps_checked = fault_steps.merge_progress(
            [r.get("fault_steps") for r in self.records]
        )
        self.fault_steps = lambda: self.fault_steps_checked
        # The learner steps earlier attempts' syncer restores rolled back (counted lost
        # there; `Ledger.rolled_spans`): each record carries the run's so far, so the last
        # one that has them is complete.
        self.rolled_before = next(
            (r["rolled_spans"] for r in reversed(self.records) if "rolled_spans" in r), {}
        )
        self.rolled = lambda: self.rolled_before
        self.t0 = time.time()
        root = epath.Path(workdir)
        if forced and changed:  # keep the config this attempt replaces
            (root / run_files.RUN_CONFIG).copy(root / f"run_config.{self.number}.json")
        self.record = {"attempt": self.number, "started": self.t0, "pid": os.getpid(),
                       "host": socket.gethostname(), "changed": changed, "forced": forced,
                       "finished": False, "own": {}}  # fmt: skip
        self.counters = lambda: {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._write()

    def watch(self, counters, fault_clock=None, checked_steps=None, rolled=None) -> None:
        """Starts the heartbeat; `counters()` returns this process's failures etc. so far,
        `fault_clock()` the run's place on its fault timeline (the runtime's),
        `checked_steps()` how far it checked a schedule in steps (None: not one),
        `rolled()` the run's rolled-back steps so far (`Ledger.rolled_spans`, seeded with
        `rolled_before`)."""
        self.counters = counters
        self.rolled = rolled or self.rolled
        self.fault_clock = fault_clock or self.fault_clock
        self.fault_steps = checked_steps or self.fault_steps
        self._thread = threading.Thread(target=self._beat, name="attempt", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self._write()

    def write_now(self) -> None:
        """Writes the record now (a failure or a loss was counted: a kill before the next
        heartbeat must not lose it); not after `stop`."""
        if self._thread is not None:
            self._write()

    def stop(self) -> None:
        """Ends the heartbeat with a last record (this attempt stays unfinished unless
        `finish` recorded it); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._write()
        # Its last reading, not the runtime's clock: holding that would keep the run's
        # learners (and their device memory) alive after the run.
        last, checked = self.record["fault_clock"], self.record.get("fault_steps")
        rolled = self.record.get("rolled_spans", {})
        self.rolled = lambda: rolled
        counted = {k: v for k, v in self.record["own"].items() if k != "wall_seconds"}
        self.fault_clock = lambda: last
        self.fault_steps = lambda: checked
        self.counters = lambda: counted

    def _write(self) -> None:
        with self._lock:
            # The clock first: a fault between the two reads is then replayed by a resume
            # after a kill, where the other order would leave it uncounted.
            self.record["fault_clock"] = self.fault_clock()
            checked = self.fault_steps()
            if checked is not None:
                self.record["fault_steps"] = checked
            rolled = self.rolled()
            if rolled:
                self.record["rolled_spans"] = rolled
            own = {k: v for k, v in self.counters().items() if k in ACCUMULATED}
            self.record["own"] = {"wall_seconds": time.time() - self.t0, **own}
            lines = [json.dumps(r) for r in [*self.records, self.record]]
            paths.write_atomic(epath.Path(self.workdir) / ATTEMPTS, "\n".join(lines) + "\n")

    def finish(self, summary: dict) -> dict:
        """Records this attempt's own counters and returns `summary` with the run's totals
        over every attempt: ACCUMULATED keys summed, `attempts`, `interrupted_attempts`
        (earlier processes that ended before the run finished: killed, crashed, preempted;
        each counts as a failure) and `stopped_attempts` (stopped by a Ctrl-C, their work
        saved: not failures). Goodput and uptime stay those of this attempt, unless it
        trained nothing (below)."""
        self.counters = lambda: {k: summary.get(k, 0) for k in ACCUMULATED}
        self.record["finished"] = True
        self.stop()
        own = dict(self.record["own"])
        total = dict(summary)
        for r in self.records:
            for k in ACCUMULATED:
                total[k] = total.get(k, 0) + r.get("own", {}).get(k, 0)
        stopped = sum(1 for r in self.records if r.get("stopped"))  # Ctrl-C: saved, no failure
        interrupted = sum(1 for r in self.records if not (r.get("finished") or r.get("stopped")))
        total["attempts"] = len(self.records) + 1
        total["interrupted_attempts"] = interrupted
        total["stopped_attempts"] = stopped
        total["failures"] = total.get("failures", 0) + interrupted
        total["this_attempt"] = own
        if "bytes_per_token" in total:  # (traffic and tokens, both of the whole run now)
            total["bytes_per_token"] = total["bytes_communicated"] / max(total["tokens"], 1)
        if summary.get("attempt_learner_steps") == 0:
            # A resume with nothing left to train (its learners had finished): the run's
            # goodput and uptime are those a Ctrl-C recorded for the last attempt it stopped.
            earlier = [r for r in self.records if r.get("accounting")]
            if earlier:
                total.update(earlier[-1]["accounting"])
                total["accounting_attempt"] = earlier[-1]["attempt"]
        return total
