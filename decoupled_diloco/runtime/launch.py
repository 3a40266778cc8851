"""Chooses the runtime named by the config and runs it in its workdir.

A workdir holds one run (runtime/workdir.py): one process at a time holds its lock; the
runtime writes its config and tokenizer there when it starts (run_files.py); a re-run with
the same config resumes it from its checkpoints (keys in `workdir.FREE_TO_CHANGE` may
differ; others, and a changed corpus, only with `force`; a changed tokenizer never,
`run_files.check_corpus`), a re-run of a finished run (summary.json written) changes
nothing, and summary.json adds up wall time and failures over every attempt.

A data-parallel run over several hosts (`distributed.*`, one JAX world) runs this on every
host: process 0 keeps the workdir's records, process i its own under `process_<i>/` (the
same rows: every process computes the same global step), and all of them write and read one
checkpoint directory, `<workdir>/checkpoints` (so the workdir must be one path every host
reaches: a bucket or a shared mount).

A run whose final global model is not finite has failed, and so has a syncer run that
merged nothing (its global model is the initial one): its summary says so and `run` raises
`ModelNotFiniteError` (the CLI exits non-zero), never returning such a model as a result.
"""

import gc
import json
import math

from decoupled_diloco import faults, paths, preflight, run_files
from decoupled_diloco.config import RunConfig
from decoupled_diloco.metrics import write_json
from decoupled_diloco.runtime import workdir as workdir_lib

SUMMARY = "summary.json"


class ModelNotFiniteError(RuntimeError):
    """The run ended with a non-finite global model."""


def run(cfg: RunConfig, workdir: str, verbose: bool = True, force: bool = False) -> dict:
    """Runs (or resumes) the run in `workdir`; `force` continues it with changed config keys
    that a resume would otherwise refuse."""
    shared, workdir = workdir, records_dir(cfg, workdir)
    preflight.check(cfg, workdir)  # config, data and run-file errors, before any write
    workdir = str(paths.resolve(workdir))  # local: absolute; gs://...: as it is
    finished = paths.resolve(workdir) / SUMMARY
    finished.parent.mkdir(parents=True, exist_ok=True)
    ckpt_dir = str(paths.resolve(shared) / "checkpoints")
    with workdir_lib.lock(workdir):
        done = finished.exists()
        stepped = workdir_lib.trained(workdir, cfg, ckpt_dir)
        fresh = not done and not stepped
        changed = workdir_lib.check_resume(workdir, cfg, done, force, stepped, ckpt_dir)
        if not done:  # a corpus that nothing trained on binds nothing either
            changed += run_files.check_corpus(workdir, cfg.data, force or fresh)
        if done:
            if verbose:
                print(f"{workdir} holds a finished run; its records are left as they were "
                      "(use another --workdir for a new run)", flush=True)  # fmt: skip
            return _checked(json.loads(finished.read_text()))
        if changed and verbose:
            how = "nothing was trained here yet: starting over" if fresh else "resuming"
            print(f"{how} with changed {', '.join(changed)}", flush=True)
        from decoupled_diloco.runtime.learner_loop import RunInterruptedError  # (jax)

        attempt = workdir_lib.Attempt(workdir, changed, forced=force)
        timed = faults.timed_in_seconds(cfg.faults) if attempt.number else []
        if timed and verbose:
            print(f"the fault schedule (faults.{', faults.'.join(timed)}) continues at "
                  f"{attempt.fault_offset:.1f} s, where the earlier attempts left it",
                  flush=True)  # fmt: skip
        try:
            runtime = _runtime(cfg, workdir, verbose, ckpt_dir, attempt)
            ledger = runtime.log.ledger
            ledger.seed_rolled(attempt.rolled_before)
            # (no local may hold the runtime or a bound method of it: the `finally` below
            # drops the last reference)
            attempt.watch(
                workdir_lib.counters_of(ledger, getattr(runtime, "bytes_communicated", None)),
                runtime.fault_clock,
                runtime.schedule.steps_checked,
                ledger.rolled_spans,
            )
            runtime.log.on_counted = attempt.write_now
            summary = attempt.finish(runtime.run())
        except RunInterruptedError as e:
            # A stop the user asked for, every learner's work saved: not a failure.
            attempt.record.update(stopped=True, accounting=e.accounting)  # (written by stop)
            raise
        finally:
            attempt.stop()  # a failed attempt's record says how far it got
            # The run's learners sit in reference cycles (runtime <-> loops, callbacks):
            # collected now, their device memory is free before the caller's next run.
            runtime = None
            gc.collect()
        loss = summary.get("final_eval_loss", math.nan)
        evaluated = not (cfg.runtime == "ray" and cfg.ray.evaluate == "off")  # NaN = not run
        if evaluated and not (isinstance(loss, float | int) and math.isfinite(loss)):
            summary["failed"] = f"the final global model is not finite (eval loss {loss})"
        elif cfg.uses_syncer and summary.get("steps") and not summary.get("merges"):
            refused = summary.get("rejected_offers", "?")
            summary["failed"] = (
                f"no offer was merged ({refused} refused, events.jsonl says why): the global "
                "model is the initial one"
            )
        write_json(finished, summary)
        return _checked(summary)


def records_dir(cfg: RunConfig, workdir: str) -> str:
    """This process's records: the workdir, or `process_<i>` in it for process i > 0 of a
    multi-host world (each with its own lock, run files and summary)."""
    i = cfg.distributed.process_id if cfg.distributed.enabled else 0
    return workdir if i == 0 else f"{workdir.rstrip('/')}/process_{i}"


def _runtime(cfg: RunConfig, workdir: str, verbose: bool, ckpt_dir: str, attempt):
    where = dict(fault_offset_s=attempt.fault_offset, fault_steps=attempt.fault_steps_checked,
                 attempt=attempt.number)  # fmt: skip
    if cfg.runtime == "ray":
        from decoupled_diloco.runtime.ray.runtime import RayRuntime

        return RayRuntime(cfg, workdir, verbose=verbose, **where)
    from decoupled_diloco.runtime.local import LocalRuntime

    return LocalRuntime(cfg, workdir, verbose=verbose, ckpt_dir=ckpt_dir, **where)


def _checked(summary: dict) -> dict:
    if summary.get("failed"):
        raise ModelNotFiniteError(f"the run failed: {summary['failed']}")
    return summary
