r"""Learner overhead on Ray: a Decoupled learner's steps/s vs plain training, side by side.

    python scripts/bench_ray_overhead.py            # 2 rounds x 80 steps per arm
    python scripts/bench_ray_overhead.py --quick    # 1 round x 40 steps (~4 min)

Learner steps/s in a Decoupled run on the Ray runtime (2 learner processes x 4 fake CPU
devices, K = 1, the tiny_decoupled model, batch and plan) vs plain training of the same
model in 2 concurrent Ray actor processes (no syncer, no link). Both are measured over the
window in which both learners run (every learner past step --skip, none finished), sampled
every 0.25 s: steps/s, and CPU seconds per step of each learner's process (/proc; its
outbox and sender threads and Ray's threads included). Neither is clean on a shared 2-core
machine: wall time moves with other load, and CPU time includes XLA's spinning worker
threads, which spin more when a process gets more of the cores. The arms' order alternates
per round. Goal: steps/s ratio >= 0.95 (communication off the learner's critical path).
"""

import json
import os
import statistics
import tempfile
import threading
import time

from decoupled_diloco import cli  # noqa: E402  (imports no JAX)

cli.xla_flags()  # before JAX starts: 8 fake CPU devices, no CUDA graphs

import ray  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco import seeds  # noqa: E402
from decoupled_diloco.config import RayConfig  # noqa: E402
from decoupled_diloco.runtime.ray import cluster as ray_cluster  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "1 round of 40 steps per arm.")
_STEPS = flags.DEFINE_integer("steps", None, "Steps per run (default 80; quick 40).")
_SKIP = flags.DEFINE_integer("skip", None, "Leading steps excluded (default 10; quick 8).")
_REPEATS = flags.DEFINE_integer("repeats", None, "Rounds of both arms (default 2; quick 1).")


def overhead_config(steps: int):
    c = config_lib.default_config()
    c.update_from_flattened_dict(
        {
            "model.preset": "tiny",
            "data.seq_len": 128,
            "train.batch_size": 32,
            "train.steps": steps,
            "train.warmup_steps": 5,
            "train.eval_every": 0,
            "train.eval_batches": 1,
            "train.log_every": 1,
            "train.checkpoint_every": 0,
            "devices_per_learner": 4,
            "runtime": "ray",
            "diloco.learners": 2,
            "diloco.sync_every": 12,
            "diloco.fragments": 6,
            "diloco.overlap": 2,
            "diloco.quorum": 1,
            "diloco.grace_gamma": 0.5,
            "diloco.max_grace": 1.0,
        }
    )
    return config_lib.validate(c)


@ray.remote(num_cpus=0, max_concurrency=2)
class PlainTrainer:
    """Plain training (no syncer, no link) of learner m's model and data in its own process."""

    def __init__(self):
        self.step = 0

    def progress(self) -> tuple[int, int]:
        return os.getpid(), self.step

    def run(self, run, m: int) -> None:
        from decoupled_diloco import compile_cache

        compile_cache.enable()
        import jax

        from decoupled_diloco.data import make_iterator
        from decoupled_diloco.sharding import make_mesh
        from decoupled_diloco.train.replica import Replica

        mesh = make_mesh(jax.devices()[: run.devices_per_learner], run.mesh)
        data = make_iterator(run.data, "train", run.train.batch_size, m, run.num_learners)
        replica = Replica(run.model, run.train, mesh)
        replica.init_from_rng(seeds.key(run.train.seed))
        for step in range(run.train.steps):
            jax.device_get(replica.step(next(data)))
            self.step = step + 1


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields from the 3rd on
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Samples every learner's (step, process CPU s) while an arm runs; `probe()` returns
    {learner: (pid, step)} or None while not every learner is up."""

    def __init__(self, probe, period: float = 0.25):
        self.samples: list[tuple[float, dict]] = []
        self._probe, self._period, self._stop = probe, period, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                seen = self._probe()
                if seen:
                    cpu = {m: (step, process_cpu_seconds(pid)) for m, (pid, step) in seen.items()}
                    self.samples.append((time.monotonic(), cpu))
            except (OSError, ValueError, ray.exceptions.RayError):
                pass  # a process not up yet or gone already

    def result(self, skip: int, steps: int) -> tuple[float, float]:
        """(steps/s, CPU s per step) per learner, mean over learners, over the window in
        which every learner is past step `skip` and none has finished."""
        self._stop.set()
        self._thread.join()
        inside = [(t, c) for t, c in self.samples if all(skip <= s < steps for s, _ in c.values())]
        # A window shorter than two samples (a fast machine, few --steps), or one in which a
        # learner made no step, has no rate: said so, not an IndexError or a division by 0.
        first, last = (inside[0][1], inside[-1][1]) if inside else ({}, {})
        if len(inside) < 2 or any(last[m][0] == step for m, (step, _) in first.items()):
            raise RuntimeError(
                f"{len(inside)} samples (every {self._period:g} s) while every learner was "
                f"within steps [{skip}, {steps}), with a step made by each between the first "
                "and last: too short a window to measure; give more --steps"
            )
        (t0, a), (t1, b) = inside[0], inside[-1]
        rate = statistics.mean((b[m][0] - a[m][0]) / (t1 - t0) for m in a)
        cpu = statistics.mean((b[m][1] - a[m][1]) / (b[m][0] - a[m][0]) for m in a)
        return rate, cpu


def plain_arm(run, skip: int) -> tuple[float, float]:
    env = {"env_vars": ray_cluster.cpu_env(run.devices_per_learner)}
    trainers = [PlainTrainer.options(runtime_env=env).remote() for _ in range(2)]
    sampler = Sampler(lambda: dict(enumerate(ray.get([t.progress.remote() for t in trainers]))))
    ray.get([t.run.remote(run, m) for m, t in enumerate(trainers)])
    out = sampler.result(skip, run.train.steps)
    for t in trainers:
        ray.kill(t)
    return out


def decoupled_arm(run, skip: int) -> tuple[float, float]:
    from decoupled_diloco.runtime.ray.runtime import RayRuntime

    workdir = tempfile.mkdtemp(prefix="dd_bench_overhead_")

    def read(name):
        try:
            with open(os.path.join(workdir, name), encoding="utf-8") as f:
                return [json.loads(line) for line in f]
        except FileNotFoundError:
            return []

    def probe():
        pids = {
            e["learner"]: e["pid"] for e in read("events.jsonl") if "pid" in e and "learner" in e
        }
        steps: dict = {}
        for row in read("metrics.jsonl"):
            if row["learner"] in pids:
                steps[row["learner"]] = max(steps.get(row["learner"], 0), row["step"])
        if len(steps) < run.num_learners:
            return None
        return {m: (pids[m], steps[m]) for m in steps}

    sampler = Sampler(probe)
    RayRuntime(run, workdir, verbose=False).run()
    return sampler.result(skip, run.train.steps)


def overhead(steps: int, skip: int, repeats: int) -> None:
    run = overhead_config(steps)
    got: dict[str, list[tuple[float, float]]] = {"plain": [], "decoupled": []}
    for r in range(repeats):
        order = ("plain", "decoupled") if r % 2 == 0 else ("decoupled", "plain")
        for arm in order:  # alternating, so a drifting machine load skews both alike
            got[arm].append((plain_arm if arm == "plain" else decoupled_arm)(run, skip))
        (pr, pc), (dr, dc) = got["plain"][-1], got["decoupled"][-1]
        print(
            f"round {r}: steps/s plain {pr:.2f} decoupled {dr:.2f} (ratio {dr / pr:.3f}); "
            f"CPU s/step plain {pc:.3f} decoupled {dc:.3f} (ratio {pc / dc:.3f})",
            flush=True,
        )
    mean = {k: [statistics.mean(x) for x in zip(*v, strict=True)] for k, v in got.items()}
    (pr, pc), (dr, dc) = mean["plain"], mean["decoupled"]
    print(
        f"\n== learner overhead on Ray (2 learners x 4 devices, tiny_decoupled plan) ==\n"
        f"steps/s    plain {pr:.2f}  decoupled {dr:.2f}  ratio {dr / pr:.3f} (goal >= 0.95)\n"
        f"CPU s/step plain {pc:.3f} decoupled {dc:.3f} ratio {pc / dc:.3f} (learner processes)"
    )


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    quick = _QUICK.value
    steps = _STEPS.value or (40 if quick else 80)
    skip = _SKIP.value or (8 if quick else 10)
    repeats = _REPEATS.value or (1 if quick else 2)
    if skip + 5 > steps:  # (as bench_learner_overhead: a window of a few steps at least)
        raise app.UsageError(f"--steps ({steps}) must exceed --skip ({skip}) by at least 5")
    from decoupled_diloco import compile_cache

    compile_cache.enable()
    started = ray_cluster.connect(RayConfig(num_cpus=2), verbose=False)
    try:
        overhead(steps, skip, repeats)
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    cli.run_script(main)
