"""Syncer merge throughput vs a plain numpy copy of the same bytes (the memory-bandwidth limit).

For a fragment of N float32 parameters and K offers (outer gradients), times the merge plus
outer Nesterov step and `np.copyto` of the K offers' bytes into preallocated arrays,
interleaved in one run so both see the same machine load. Throughput is K·N·4 bytes of
offers per second; the goal is merge ≥ 0.5 × copy at K = 4, where the copy uses as many
threads as the merge (`--threads`, default every core: a syncer host merges with all its
cores, `diloco.merge_threads`).

That goal cannot be met for every K: the copy reads and writes K·N floats, while any merge
plus outer step must at least read the K offers, Θ and the momentum and write Θ and the
momentum, (K + 4)·N floats, so at memory speed merge/copy ≤ 2K / (K + 4) (0.40, 0.67,
1.00, 1.33 for K = 1, 2, 4, 8). The `bound` column prints it and `of bound` how close a
path gets; the syncer path also writes Θ into its reply (+N: bound 2K / (K + 5)).

Paths:
  fused        merge.merge_outer_step(..., inplace=True, scratch=...): the syncer owns Θ and
               the momentum, and RDA's direction goes into reused memory (chunks.Scratch)
  fused 1t     the same on one thread
  fused+norms  the same, given each offer's per-leaf ‖v‖² (`merge.offer_sq_norms`), which
               a syncer can compute when the offer arrives, off the merge's critical path
  composed     merge.merge then merge.outer_step: allocates Δ, Θ and momentum each call
  syncer       Syncer._merge itself on K pending offers (diloco.merge = the rule): the fused
               in-place path with arrival-time norms, plus its bookkeeping and the reply
               ("none": the outer step also writes Θ into a reply buffer no receiver holds
               any more, reply_buffers.py; the bench keeps no reply); the offers' arrival
               (decode, validation, ‖v‖²) runs untimed before each repetition, as it does
               off the merge's critical path

  python scripts/bench_syncer_merge.py            # N ∈ {4M, 16M}, K ∈ {1, 2, 4, 8}
  python scripts/bench_syncer_merge.py --quick    # N ∈ {1M, 4M}, fewer repetitions

--part=gil: the merge beside busy Python threads, i.e. what sharing the interpreter lock
costs it. In the local runtime the learners, their outboxes and stagers, the syncer and its
merge threads are threads of one process. numpy lets go of the lock inside each call and
takes it back after; a thread that wants it back while another runs Python waits until that
one lets go, at the latest when Python's switch interval (5 ms by default) tells it to. A
merge makes a few hundred numpy calls (per leaf and per chunk), so beside busy threads its
time grows with their bursts, not with its bytes: on one H100 host, four `mid` learners
sharing the GPU saw 123 ms merges (2026-11-26, experiments/results/quality_targets_mid_h100/).
This part times `Syncer._merge` on the largest fragment of a model preset (`--k` pending
offers) alone and beside `--busy_threads` threads that each run Python for `--busy_ms` of
every `--busy_every_ms` (a learner thread's dispatch and bookkeeping between device waits),
for Python's switch interval and the runtime's (`gil_switch_ms`) and for chunk sizes,
interleaved in one run. "bursts/s kept" is the busy threads' rate with merges running back
to back, as a share of their rate without merges: what the shorter interval costs them.
A last row times the same merge in a syncer process of its own (`local_syncer = "process"`)
as the busy threads' process sees it: the K offers copied across through shared memory, the
merge there, Θ copied back (runtime/syncer_process.py), against the last row on a thread.

  python scripts/bench_syncer_merge.py --part=gil           # mid, K 2, 4 busy threads
  python scripts/bench_syncer_merge.py --part=gil --quick   # tiny, 3 repetitions
"""

import multiprocessing
import os
import statistics
import sys
import threading
import time

import jax
import numpy as np
from absl import flags

from decoupled_diloco import cli
from decoupled_diloco import config as config_lib
from decoupled_diloco.diloco import chunks, compression, merge, outer
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan, model_plan
from decoupled_diloco.diloco.messages import Offer
from decoupled_diloco.diloco.syncer import Syncer
from decoupled_diloco.models.transformer import _leaves, init_params
from decoupled_diloco.runtime.wire import Wire

_QUICK = flags.DEFINE_bool("quick", False, "Small fragments and 3 repetitions (about 10 s).")
_SIZES = flags.DEFINE_list("sizes", None, "Fragment sizes in Mi-params (default 4,16; quick 1,4).")
_KS = flags.DEFINE_list("ks", ["1", "2", "4", "8"], "Numbers of offers K merged at once.")
_REPS = flags.DEFINE_integer("reps", None, "Timed repetitions per cell (default 7; quick 3).")
_THREADS = flags.DEFINE_integer(
    "threads", 0, "Threads per merge and per copy (diloco.merge_threads; 0 = every core)."
)
PYTHON_SWITCH_MS = 5.0  # Python's default switch interval
_PART = flags.DEFINE_enum("part", "throughput", ["throughput", "gil"], "Which benchmark.")
_PRESET = flags.DEFINE_string(
    "preset", None, "gil: the preset whose fragment merges (mid; quick tiny)."
)
_FRAGMENTS = flags.DEFINE_integer(
    "fragments", 6, "gil: fragments P of the model (6, tiny_decoupled's)."
)
_K = flags.DEFINE_integer("k", 2, "gil: offers per merge (2: the H100 fleet's mean).")
_RULE = flags.DEFINE_enum("rule", "rda", ["rda", "mean"], "gil: merge rule (diloco.merge).")
_BUSY = flags.DEFINE_integer("busy_threads", 4, "gil: Python threads running beside the merges.")
_BUSY_MS = flags.DEFINE_float("busy_ms", 0.5, "gil: milliseconds of Python per burst.")
_EVERY_MS = flags.DEFINE_float("busy_every_ms", 2.5, "gil: a burst starts every this many ms.")
_SWITCH = flags.DEFINE_list(
    "switch_ms", ["5", str(config_lib.GIL_SWITCH_MS)], "gil: switch intervals compared (ms)."
)
_MOMENTUM = flags.DEFINE_float(
    "outer_momentum", 0.0, "gil: the syncer's outer momentum (0: the decoupled configs')."
)
_CHUNKS = flags.DEFINE_list("chunks", ["65536", str(chunks.CHUNK)], "gil: chunk sizes compared.")

MIN_SIZE = 0.01  # Mi-params: room for fragment_leaves' four leaves


def _numbers(values, kind, low) -> bool:
    try:
        return all(kind(v) >= low for v in values)
    except ValueError:
        return False


flags.register_validator("sizes", lambda v: v is None or _numbers(v, float, MIN_SIZE),
                         f"--sizes: Mi-params, each at least {MIN_SIZE}")  # fmt: skip
flags.register_validator("ks", lambda v: bool(v) and _numbers(v, int, 1),
                         "--ks: offers per merge, integers >= 1")  # fmt: skip
flags.register_validator("reps", lambda v: v is None or v >= 1, "--reps: at least 1")
flags.register_validator("threads", lambda v: v >= 0, "--threads: >= 0 (0: every core)")
flags.register_validator("k", lambda v: v >= 1, "--k: offers per merge, at least 1")
# --part=gil's flags, refused here rather than as a traceback after the first measurements:
# with no busy thread the "bursts/s kept" column divides by an idle rate of 0.
flags.register_validator("busy_threads", lambda v: v >= 1, "--busy_threads: at least 1")
flags.register_validator("chunks", lambda v: bool(v) and _numbers(v, int, 1),
                         "--chunks: elements per chunk, integers >= 1")  # fmt: skip
flags.register_validator("switch_ms", lambda v: bool(v) and _numbers(v, float, 0),
                         "--switch_ms: milliseconds >= 0 (0: Python's default)")  # fmt: skip


def fragment_leaves(n: int) -> dict[str, int]:
    """A fragment of n elements split like real ones: a few big matrices and a small norm."""
    sizes = {"ffw/gate": n // 2, "attn/q": n // 4, "norm/scale": 1024}
    sizes["attn/out"] = n - sum(sizes.values())
    return sizes


def timed(path) -> float:
    """Seconds of one call; `path` is fn or (untimed setup, fn)."""
    setup, fn = path if isinstance(path, tuple) else (None, path)
    if setup is not None:
        setup()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def syncer_path(theta: dict, payloads: list, w: np.ndarray, rule: str, threads: int,
                momentum: float = DilocoConfig.outer_momentum) -> tuple:  # fmt: skip
    """(push the K offers, Syncer._merge) on a one-fragment syncer owning a copy of Θ."""
    k = len(payloads)
    plan = make_fragment_plan({name: x.shape for name, x in theta.items()}, 1)
    # Quorum K + 1 with only K offering: offers stay pending until _merge is called.
    cfg = DilocoConfig(learners=k + 1, sync_every=1, quorum=k + 1, grace_gamma=0.0, merge=rule,
                       max_staleness=1 << 30, merge_threads=threads,
                       outer_momentum=momentum)  # fmt: skip
    syncer = Syncer(cfg, plan, theta)
    for m in range(k + 1):
        syncer.register(m, 0, True, 0.0, 1 << 40)
    tokens = np.maximum(1, np.round(1000 * np.sqrt(w))).astype(int)
    step = [0]

    def push():
        step[0] += 1  # every push holds each learner's next step
        for m, payload in enumerate(payloads):
            fields = dict(step=step[0], c_steps=1, c_tokens=int(tokens[m]), time=0.0, nbytes=1)
            offer = Offer(m, 0, 0, base_version=syncer.version[0], payload=payload, **fields)
            syncer.handle(offer, 0.0)
        assert len(syncer.pending[0]) == k

    return push, lambda: syncer._merge(0, 0.0)


def bench_cell(
    n: int, k: int, reps: int, rng: np.random.Generator, threads: int
) -> list[tuple[str, float]]:
    """Median seconds per path (and of the copy) over `reps` interleaved repetitions."""
    leaves = fragment_leaves(n)
    theta = {name: rng.standard_normal(size, np.float32) for name, size in leaves.items()}
    payloads = [  # the offers as a syncer receives them; vs are zero-copy views of them
        compression.encode(
            {name: 1e-3 * rng.standard_normal(size, np.float32) for name, size in leaves.items()},
            "none",
        )
        for _ in range(k)
    ]
    vs = [compression.decode(payload) for payload in payloads]
    copies = [{name: np.empty_like(x) for name, x in v.items()} for v in vs]
    w = rng.uniform(0.5, 2.0, k)
    state = merge.OuterState.zeros(theta)
    lr, mu = 0.7, 0.9

    def copy():  # the same spans of chunks on the same threads as a merge
        for v, dst in zip(vs, copies, strict=True):
            for name, x in v.items():
                chunks.copy(x, dst[name], threads)

    paths = {"copy": copy}
    norms = [merge.offer_sq_norms(v) for v in vs]  # a syncer computes these on arrival
    scratch = chunks.Scratch()  # RDA's direction u in reused memory, as the syncer does
    one = dict(inplace=True, threads=1, scratch=scratch)
    for rule in merge.RULES:
        paths[f"{rule} fused 1t"] = lambda r=rule: merge.merge_outer_step(
            theta, vs, w, r, state, lr, mu, **one
        )
        paths[f"{rule} fused"] = lambda r=rule: merge.merge_outer_step(
            theta, vs, w, r, state, lr, mu, inplace=True, threads=threads, scratch=scratch
        )
        if rule == "rda":
            paths["rda fused+norms"] = lambda: merge.merge_outer_step(
                theta,
                vs,
                w,
                "rda",
                state,
                lr,
                mu,
                inplace=True,
                sq_norms=norms,
                threads=threads,
                scratch=scratch,
            )
        paths[f"{rule} composed"] = lambda r=rule: outer.outer_step(
            theta, merge.merge(vs, w, r), state, lr, mu
        )
        paths[f"{rule} syncer"] = syncer_path(theta, payloads, w, rule, threads)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for path in paths.values():  # warm-up: first touch of every buffer
        timed(path)
    for _ in range(reps):
        for name, fn in paths.items():
            times[name].append(timed(fn))
    return [(name, statistics.median(ts)) for name, ts in times.items()]


def fragment(preset: str, num_fragments: int) -> dict[str, np.ndarray]:
    """The largest fragment of `preset` split into `num_fragments`: {leaf: float32 Θ}."""
    c = config_lib.tiny_cpu_config("bench", preset=preset, learners=2)
    config_lib.set_decoupled(c)
    c.diloco.fragments = num_fragments
    c.devices_per_learner = 1
    run = config_lib.validate(c)
    shapes = jax.eval_shape(lambda: init_params(run.model, jax.random.key(0)))
    zeros = {k: np.zeros(v.shape, np.float32) for k, v in _leaves(shapes).items()}
    parts = model_plan(run.model, run.diloco).split(zeros)
    rng = np.random.default_rng(0)
    biggest = max(parts, key=lambda p: sum(v.size for v in p.values()))
    return {k: rng.standard_normal(v.shape, np.float32) for k, v in biggest.items()}


class Busy:
    """`n` threads, each running Python for `busy_s` of every `every_s` seconds."""

    def __init__(self, n: int, busy_s: float, every_s: float):
        self.n, self.busy_s, self.every_s = n, busy_s, every_s
        self.bursts, self._stop, self._threads = [0] * n, threading.Event(), []

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            while time.perf_counter() - start < self.busy_s:
                pass
            self.bursts[i] += 1
            time.sleep(max(self.every_s - (time.perf_counter() - start), 0.0))

    def __enter__(self):
        self._stop.clear()
        self.bursts = [0] * self.n
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(self.n)]
        self._t0 = time.perf_counter()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join()
        self.rate = sum(self.bursts) / (time.perf_counter() - self._t0)


def timed_merges(push, merge, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        push()  # the offers' arrival: untimed, as it is off the merge's critical path
        start = time.perf_counter()
        merge()
        out.append(time.perf_counter() - start)
    return out


def gil_main() -> None:
    """--part=gil (module docstring)."""
    quick = _QUICK.value
    preset = _PRESET.value or ("tiny" if quick else "mid")
    reps = _REPS.value if _REPS.value is not None else (3 if quick else 7)
    theta = fragment(preset, _FRAGMENTS.value)
    rng = np.random.default_rng(1)
    payloads = [
        compression.encode(
            {k: 1e-3 * rng.standard_normal(v.shape, np.float32) for k, v in theta.items()}, "none"
        )  # fmt: skip
        for _ in range(_K.value)
    ]
    w = rng.uniform(0.5, 2.0, _K.value)
    push, merge = syncer_path(theta, payloads, w, _RULE.value, _THREADS.value, _MOMENTUM.value)
    size = sum(v.size for v in theta.values())
    busy = (_BUSY.value, _BUSY_MS.value / 1e3, _EVERY_MS.value / 1e3)
    print(
        f"load average {os.getloadavg()[0]:.2f} on {chunks.host_cores()} cores; {preset}'s "
        f"largest of {_FRAGMENTS.value} fragments: {len(theta)} leaves, {size / 1e6:.2f}M "
        f"params; K {_K.value}, {_RULE.value}, outer momentum {_MOMENTUM.value:g}, "
        f"{chunks.resolve_threads(_THREADS.value)} merge "
        f"threads; {busy[0]} busy threads, each {_BUSY_MS.value:g} ms of Python every "
        f"{_EVERY_MS.value:g} ms; median of {reps} merges"
    )
    print(f"{'switch ms':>9} {'chunk':>8} {'alone ms':>9} {'beside ms':>10} {'beside/alone':>12} "
          f"{'bursts/s kept':>13}")  # fmt: skip
    before_interval, before_chunk = sys.getswitchinterval(), chunks.CHUNK
    beside_ms = {}
    try:
        for switch in (float(s) for s in _SWITCH.value):
            sys.setswitchinterval((switch or PYTHON_SWITCH_MS) / 1e3)  # 0: Python's
            with Busy(*busy) as idle_run:  # the busy threads' own rate, nothing merging
                time.sleep(0.5)
            for chunk in (int(c) for c in _CHUNKS.value):
                chunks.CHUNK = chunk
                timed_merges(push, merge, 1)  # warm-up: buffers touched at this chunk size
                alone = statistics.median(timed_merges(push, merge, reps))
                with Busy(*busy) as beside_run:
                    beside = statistics.median(timed_merges(push, merge, reps))
                beside_ms[switch, chunk] = beside
                print(
                    f"{switch:>9g} {chunk:>8} {1e3 * alone:>9.2f} {1e3 * beside:>10.2f} "
                    f"{beside / alone:>12.2f} {beside_run.rate / idle_run.rate:>13.2f}",
                    flush=True,
                )
    finally:
        sys.setswitchinterval(before_interval)
        chunks.CHUNK = before_chunk
    first, last = next(iter(beside_ms)), list(beside_ms)[-1]
    print(
        f"merge beside busy threads, switch {first[0]:g} ms / chunk {first[1]} ÷ switch "
        f"{last[0]:g} ms / chunk {last[1]} = {beside_ms[first] / beside_ms[last]:.2f}"
    )
    process_rounds(theta, payloads, w, reps, busy, beside_ms[last])


def _round_server(conn, theta, k, w, rule, threads, momentum) -> None:
    """A syncer process's side of `process_rounds`: merges the K offers of each round it is
    sent and answers with Θ and how long the merge took there."""
    received: list = [None] * k
    push, merge_fn = syncer_path(theta, received, w, rule, threads, momentum)
    end = Wire(conn)
    while True:
        kind, _, obj = end.recv()
        if kind != "round":
            break
        received[:] = obj
        push()
        start = time.perf_counter()
        (_, reply), *_ = merge_fn()  # one Merged for every learner: it crosses once
        merge_s = time.perf_counter() - start
        end.send("theta", reply, merge_s=merge_s)
    end.settle(30.0)
    end.close()


def process_rounds(theta, payloads, w, reps: int, busy: tuple, thread_beside_s: float) -> None:
    """The same merge in a syncer process of its own (`local_syncer = "process"`), as the
    learners' process sees it beside its busy threads: the K offers cross the wire, the child
    merges them, Θ comes back. Its threads never wait for this process's interpreter lock."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_round_server, daemon=True,
                        args=(theirs, theta, len(payloads), w, _RULE.value, _THREADS.value,
                              _MOMENTUM.value))  # fmt: skip
    child.start()
    theirs.close()
    end = Wire(ours)

    def rounds(n: int) -> tuple[float, float]:
        total, merged = [], []
        for _ in range(n):
            start = time.perf_counter()
            end.send("round", payloads)
            _, meta, _ = end.recv()
            total.append(time.perf_counter() - start)
            merged.append(meta["merge_s"])
        return statistics.median(total), statistics.median(merged)

    try:
        rounds(2)  # warm-up: the child's imports are done, segments mapped
        alone, alone_merge = rounds(reps)
        with Busy(*busy) as idle_run:
            time.sleep(0.5)
        with Busy(*busy) as beside_run:
            beside, beside_merge = rounds(reps)
        end.send("stop")
        child.join(30)
    finally:
        end.close()
        if child.is_alive():
            child.kill()
    print(f"{'syncer process':>18} {'alone ms':>9} {'beside ms':>10} {'of which merge':>14} "
          f"{'bursts/s kept':>13}")  # fmt: skip
    print(
        f"{'offers -> Θ back':>18} {1e3 * alone:>9.2f} {1e3 * beside:>10.2f} "
        f"{1e3 * beside_merge:>14.2f} {beside_run.rate / idle_run.rate:>13.2f}"
    )
    print(
        f"syncer process round beside busy threads ÷ the merge beside them on a thread "
        f"(last row above) = {beside / thread_beside_s:.2f} (merge alone there "
        f"{1e3 * alone_merge:.2f} ms)"
    )


def main(argv):
    del argv
    if _PART.value == "gil":
        gil_main()
        return
    quick = _QUICK.value
    sizes = [float(s) for s in (_SIZES.value or (["1", "4"] if quick else ["4", "16"]))]
    reps = _REPS.value if _REPS.value is not None else (3 if quick else 7)
    rng = np.random.default_rng(0)
    # Shared machines skew both columns; the load average says how much to trust them.
    threads = chunks.resolve_threads(_THREADS.value)
    print(
        f"load average {os.getloadavg()[0]:.2f} on {chunks.host_cores()} cores; {threads} "
        f"threads per merge and per copy ('1t': one thread); median of {reps} runs"
    )
    print(
        f"{'params':>8} {'K':>2} {'path':<16} {'ms':>8} {'GB/s':>7} {'copy GB/s':>9} {'ratio':>6}"
        f" {'bound':>6} {'of bound':>8}"
    )
    for size in sizes:
        n = int(size * 2**20)
        for k in (int(x) for x in _KS.value):
            results = dict(bench_cell(n, k, reps, rng, threads))
            gigabytes = k * n * 4 / 1e9
            copy_rate = gigabytes / results.pop("copy")
            for name, seconds in results.items():
                rate = gigabytes / seconds
                bound = 2 * k / (k + (5 if name.endswith("syncer") else 4))
                ratio = rate / copy_rate
                print(
                    f"{size:>7g}M {k:>2} {name:<16} {1e3 * seconds:>8.1f} {rate:>7.2f} "
                    f"{copy_rate:>9.2f} {ratio:>6.2f} {bound:>6.2f} {ratio / bound:>8.2f}"
                )


if __name__ == "__main__":
    cli.run_script(main)
