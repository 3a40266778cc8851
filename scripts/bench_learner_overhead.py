r"""Learner overhead: steps/s of a learner inside a Decoupled run vs plain training, side by side.

    python scripts/bench_learner_overhead.py            # 3 rounds x 80 steps per arm, ~4 min
    python scripts/bench_learner_overhead.py --quick    # 2 rounds x 40 steps, ~2 min

The model, batch and fragment schedule are those of configs/tiny_decoupled.py. Learner 0
always runs on devices 0-3 of the 8 fake CPU devices; each round runs the arms in turn
(so a busy machine skews all of them alike):

  plain       learners=1, sync_every=0 on devices 0-3: a plain training loop, alone
  plain+peer  the same, while a second plain training loop (its own thread, mesh over
              devices 4-7, same model and batch) runs throughout: the apples-to-apples
              baseline, because on this 2-core machine every fake device shares the same
              cores, so a decoupled learner always has a peer competing for them
  decoupled   2 learners x 4 devices, K=1, P, H, tau, grace as tiny_decoupled, plus the
              syncer thread (its merges also run on these 2 cores; on real hardware the
              syncer is a separate CPU host)

Learner 0's rate comes from its metrics.jsonl rows (log_every=1): steps per second between
its row at step --skip (compilation excluded) and the last row before any learner stopped.
The goal is decoupled / plain+peer >= 0.95 (communication off the critical path);
decoupled / plain shows the raw cost of sharing the machine with a second learner. The OS
may split the two cores unevenly between learner 0 and its peer (in plain+peer the peer
often gets a third), so the script also prints the ratio of both learners' steps/s.
The decoupled arm also times learner 0's step boundary (`LearnerLoop._boundary`: offering
due fragments, applying arrived merges, heartbeats), the only syncer work on the learner's own
thread, as a share of its step time: what remains of a gap is other threads (transport,
syncer) competing for the same cores, and load from outside.
"""

import contextlib
import json
import os
import pathlib
import shutil
import statistics
import threading
import time

from decoupled_diloco import cli  # noqa: E402  (imports no JAX)

cli.xla_flags()  # before JAX starts: 8 fake CPU devices, no CUDA graphs

import jax  # noqa: E402
from absl import flags, logging  # noqa: E402

from decoupled_diloco import compile_cache  # noqa: E402
from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco.data import make_iterator  # noqa: E402
from decoupled_diloco.runtime.learner_loop import LearnerLoop  # noqa: E402
from decoupled_diloco.runtime.local import LocalRuntime  # noqa: E402
from decoupled_diloco.sharding import make_mesh  # noqa: E402
from decoupled_diloco.train.replica import Replica  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "2 rounds of 40 steps per arm (~2 min).")
_STEPS = flags.DEFINE_integer("steps", None, "Steps per run (default 80; quick 40).")
_SKIP = flags.DEFINE_integer("skip", None, "Leading steps excluded (default 10; quick 8).")
_ROUNDS = flags.DEFINE_integer("rounds", None, "Rounds of all arms (default 3; quick 2).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dd_bench_overhead", "Run directories.")

ARMS = ("plain", "plain+peer", "decoupled")
CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_decoupled.py"


def arm_config(arm: str, steps: int):
    """tiny_decoupled with 4 devices per learner, no evals or checkpoints, a row per step."""
    c = _load_tiny_decoupled()
    c.train.steps = steps
    c.train.eval_every = 0
    c.train.eval_batches = 1  # the final evaluation only; outside the timed window
    c.train.log_every = 1
    c.train.checkpoint_every = 0
    c.devices_per_learner = 4
    if arm == "decoupled":
        c.diloco.learners = 2
    else:
        c.diloco.learners = 1
        c.diloco.sync_every = 0
    return c


def _load_tiny_decoupled():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_decoupled_config", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


class Peer:
    """A plain training loop on devices 4-7 in its own thread; records its step end times."""

    def __init__(self, run: config_lib.RunConfig):
        mesh = make_mesh(jax.devices()[4:8], run.mesh)
        self.data = make_iterator(run.data, "train", run.train.batch_size, 1, 2)
        self.replica = Replica(run.model, run.train, mesh)
        self.times: list[float] = []  # time.monotonic() at the end of each step
        self.stop = threading.Event()
        self.warm = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="peer", daemon=True)

    def _loop(self) -> None:
        try:
            self.replica.init_from_rng(jax.random.key(1))
            while not self.stop.is_set():
                jax.device_get(self.replica.step(next(self.data)))  # a row per step, as logged
                self.times.append(time.monotonic())
                if len(self.times) == 3:  # compiled and past the first steps
                    self.warm.set()
        finally:
            self.warm.set()  # never leave __enter__ waiting on a failed peer

    def __enter__(self):
        self.thread.start()
        self.warm.wait()
        if not self.thread.is_alive():
            raise RuntimeError("the peer training loop failed before warming up")
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def rate(self, t_from: float, t_to: float) -> float:
        """Steps per second completed within [t_from, t_to] (monotonic clock)."""
        inside = [t for t in self.times if t_from <= t <= t_to]
        return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 1 else float("nan")


def _rows(workdir: pathlib.Path) -> dict:
    """Learner id -> [(step, time)] from metrics.jsonl, time in the runtime's clock."""
    out: dict = {}
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if isinstance(r.get("learner"), int) and "loss" in r:
                out.setdefault(r["learner"], []).append((r["step"], r["time"]))
    return {m: sorted(v) for m, v in out.items()}


def window(rows: dict, skip: int) -> tuple[float, float]:
    """[start, end]: every learner is past step `skip` and none has finished."""
    start = max(next(t for s, t in v if s >= skip) for v in rows.values())
    end = min(v[-1][1] for v in rows.values())
    return start, end


def rate_in(rows: list, t_from: float, t_to: float) -> float:
    """Steps per second between the first and last row inside [t_from, t_to]."""
    inside = [(s, t) for s, t in rows if t_from <= t <= t_to]
    if len(inside) < 2:
        return float("nan")
    (s0, t0), (s1, t1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


@contextlib.contextmanager
def timed_boundary(learner_id: int, skip: int):
    """Records the seconds of each of `learner_id`'s step boundaries after step `skip`."""
    original, seconds = LearnerLoop._boundary, []

    def boundary(self):
        start = time.perf_counter()
        original(self)
        if self.m == learner_id and self.step > skip:
            seconds.append(time.perf_counter() - start)

    LearnerLoop._boundary = boundary
    try:
        yield seconds
    finally:
        LearnerLoop._boundary = original


def run_arm(arm: str, steps: int, skip: int, workdir: pathlib.Path) -> dict:
    if workdir.exists():
        shutil.rmtree(workdir)  # a stale run would be resumed from its checkpoints
    run = config_lib.validate(arm_config(arm, steps))
    rt = LocalRuntime(run, str(workdir), verbose=False)
    boundary: list[float] = []
    if arm == "plain+peer":
        with Peer(run) as peer:
            summary = rt.run()
    elif arm == "decoupled":
        with timed_boundary(0, skip) as boundary:
            peer, summary = None, rt.run()
    else:
        peer, summary = None, rt.run()
    rows = _rows(workdir)
    start, end = window(rows, skip)
    out = {"learner0": rate_in(rows[0], start, end), "window_s": end - start}
    if arm == "decoupled":
        out["other"] = rate_in(rows[1], start, end)
        out["merges"] = summary["merges"]
        out["bytes_per_token"] = summary["bytes_per_token"]
        out["boundary_share"] = statistics.mean(boundary) * out["learner0"]
    elif peer is not None:
        out["other"] = peer.rate(rt.t0 + start, rt.t0 + end)
    return out


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    compile_cache.enable()
    quick = _QUICK.value
    steps = _STEPS.value or (40 if quick else 80)
    skip = _SKIP.value or (8 if quick else 10)
    rounds = _ROUNDS.value or (2 if quick else 3)
    if skip + 5 > steps:
        raise ValueError(f"--steps ({steps}) must exceed --skip ({skip}) by at least 5")
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {rounds} rounds x "
        f"{steps} steps per arm, first {skip} steps excluded",
        flush=True,
    )
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    print(f"{'round':>5} {'arm':<11} {'learner0 st/s':>13} {'other st/s':>10} {'window s':>8}")
    for r in range(rounds):
        for arm in ARMS:
            res = run_arm(arm, steps, skip, pathlib.Path(_WORKDIR.value) / arm.replace("+", "_"))
            results[arm].append(res)
            print(
                f"{r:>5} {arm:<11} {res['learner0']:>13.2f} {res.get('other', float('nan')):>10.2f}"
                f" {res['window_s']:>8.1f}",
                flush=True,
            )
    med = {arm: statistics.median(x["learner0"] for x in v) for arm, v in results.items()}
    per_round = [
        (d["learner0"] / pp["learner0"], d["learner0"] / p["learner0"])
        for p, pp, d in zip(
            results["plain"], results["plain+peer"], results["decoupled"], strict=True
        )
    ]
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    print("| arm | learner 0 steps/s (median) | total steps/s of both learners |")
    print("|---|---|---|")
    for arm in ARMS:
        both = statistics.median(x["learner0"] + x.get("other", 0.0) for x in results[arm])
        print(f"| {arm} | {med[arm]:.2f} | {both:.2f} |")
    vs_peer = statistics.median(a for a, _ in per_round)
    vs_plain = statistics.median(b for _, b in per_round)
    print(
        f"\ndecoupled / plain+peer = {vs_peer:.3f} (goal >= 0.95; per round "
        f"{', '.join(f'{a:.3f}' for a, _ in per_round)})"
    )
    print(
        f"decoupled / plain      = {vs_plain:.3f} (per round "
        f"{', '.join(f'{b:.3f}' for _, b in per_round)}): includes sharing 2 cores with a peer"
    )
    totals = [
        (d["learner0"] + d["other"]) / (pp["learner0"] + pp["other"])
        for pp, d in zip(results["plain+peer"], results["decoupled"], strict=True)
    ]
    print(
        f"decoupled / plain+peer, both learners' steps/s = {statistics.median(totals):.3f} "
        f"(per round {', '.join(f'{t:.3f}' for t in totals)}): the two cores need not be "
        "split evenly between learner 0 and its peer, so learner 0's rate alone can mislead"
    )
    merges = statistics.median(x["merges"] for x in results["decoupled"])
    bpt = statistics.median(x["bytes_per_token"] for x in results["decoupled"])
    share = statistics.median(x["boundary_share"] for x in results["decoupled"])
    print(
        f"decoupled run: {merges:.0f} merges, {bpt:.1f} bytes communicated per token; "
        f"learner 0's step boundary (offers, merges applied) = {100 * share:.1f}% of its step time"
    )


if __name__ == "__main__":
    cli.run_script(main)
