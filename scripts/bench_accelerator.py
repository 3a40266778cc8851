r"""Learners at accelerator speed: learner overhead, MFU / memory of a preset, fleet.

    python scripts/bench_accelerator.py                  # on the machine's accelerator(s)
    python scripts/bench_accelerator.py --quick          # 8 fake CPU devices, tiny model, ~3 min
    python scripts/bench_accelerator.py --part=overhead  # or --part=mfu, --part=fleet
    python scripts/bench_accelerator.py --part=overhead --emulate_step_ms=10 --dtype=float32
        # no accelerator: the mid learner's step is a 10 ms emulated device (sleeps), the
        # rest (data, boundaries, transfers, outbox, syncer, stager) runs for real

(a) Learner overhead, side by side in one run, rounds alternating the arms so a busy
    machine skews them alike. Every arm is one learner on the same devices, model and batch
    (default: the `mid` preset, 32 x 256 tokens per step, the shape of the quality issue):
      plain        sync_every=0: a plain training loop
      decoupled    the same learner inside Decoupled DiLoCo (tiny_decoupled's syncer
                   settings: H 12, P 6, tau 2, K 1, RDA), its syncer a thread of this process
      no-pipeline  decoupled with train.prefetch=0 and diloco.stage_merges=False: data read
                   and merges computed on the learner's thread (what the pipeline buys)
      ckpt-duty1   decoupled with diloco.syncer_checkpoint_duty=1: the syncer's checkpoints
                   every 5 s however long they take (what the duty bound buys)
      py-switch    decoupled with gil_switch_ms=0: Python's 5 ms thread switch interval
                   instead of the run's (what the short interval buys, runtime/gil.py)
      host-rebase  decoupled with diloco.device_rebase=False: each merge's rebase computed
                   on the host, then placed (what computing it on the devices buys)
      syncer-proc  decoupled with local_syncer=process: the syncer's merges, outer steps,
                   checkpoints and replies in a process of its own, off this interpreter's
                   lock (what the learner loses to the syncer's Python; --local_syncer
                   sets every decoupled arm's, this one's stays a process)
    Rates come from the runs' metrics rows (log_every=1): steps per second between the row
    at --skip (compilation excluded) and the last one. Prints decoupled / plain (goal >= 0.95)
    and the learner's host_share (the share of its step the learner thread spent on host work
    instead of waiting for the device: near 1, the device starves) and cpu_share (of that,
    the share it ran on a CPU, `time.thread_time`; host_share - cpu_share is time the thread
    was ready but not running: the interpreter lock other threads held, the OS run queue),
    the merges it deferred
    (their update not placed on the device in time) and stage_ms (computing and placing one
    merge's update, the stager's moving mean).
(b) MFU and peak memory of --mfu_preset at the largest batch that fits, for each remat
    policy (--remat, in that order): the largest --mfu_batch·2^k <= --max_batch whose compiled
    step's memory (`memory_analysis()`) fits 95% of the device, found from the plans of
    --mfu_batch and twice it (memory grows linearly with the batch) and one compile to
    confirm (`mfu.largest_fitting_batch`); that batch then runs --mfu_steps timed steps.
    MFU = model FLOPs/token x tokens/s / (devices x peak); blank where the device's peak is
    unknown (CPU). On CPU the plans say nothing about remat: XLA's CPU compiler plans the
    same temporaries with and without `jax.checkpoint` (2026-11-26: `mid` at 8 x 1024,
    11.97 / 11.94 / 11.96 GiB for none / full / dots; a checkpointed 8-block MLP 1.375 GiB
    either way), and gemma_2b's plan at 4 x 1024 is 98.7 GiB where an H100 measured a
    57.8 GiB peak: only an accelerator shows what remat saves and which batch fits.
(c) --part=fleet (not in "all"): --learners decoupled learners (default 4) sharing the
    devices, as the `mid` quality runs do, beside one plain loop there: fleet steps/s ÷ the
    plain loop's (how much of the device the fleet keeps busy), steps per offer (H when the
    syncer and the pipelines keep up; more when offers wait for late merges, which costs
    quality) and the merge delay in steps. With --emulate_step_ms the learners enqueue on one
    emulated device, so a CPU host measures whether its cores keep up with that device.
    --gil_switch_ms sets the fleet's thread switch interval (0: Python's), to compare.
"""

import json
import os
import pathlib
import shutil
import statistics
import sys
import threading

from absl import app, flags, logging

from decoupled_diloco import cli  # imports no JAX

_QUICK = flags.DEFINE_bool("quick", False, "Fake CPU devices, tiny model, short runs (~3 min).")
_PART = flags.DEFINE_enum(
    "part", "all", ["all", "overhead", "mfu", "fleet"], "Which measurement (all: overhead, mfu)."
)
_LEARNERS = flags.DEFINE_integer("learners", 4, "Fleet: decoupled learners sharing the devices.")
_PRESET = flags.DEFINE_string("preset", None, "Overhead model preset (default mid; quick tiny).")
_BATCH = flags.DEFINE_integer("batch", None, "Overhead sequences per step (32; quick 8).")
_SEQ = flags.DEFINE_integer("seq_len", None, "Tokens per sequence (256; quick 64).")
_STEPS = flags.DEFINE_integer("steps", None, "Steps per overhead run (200; quick 40).")
_SKIP = flags.DEFINE_integer("skip", None, "Leading steps excluded (20; quick 8).")
_WARMUP = flags.DEFINE_bool(
    "warmup", True, "Overhead: before the rounds, one untimed run of every arm (--skip + 10 "
    "steps), so what a process compiles once (the protocol's fragment ops, compiled in the "
    "background as a learner starts) is not in the first round's window; the compile_s "
    "column shows what still was."
)  # fmt: skip
_ROUNDS = flags.DEFINE_integer("rounds", None, "Rounds of all overhead arms (3; quick 2).")
_DEVICES = flags.DEFINE_integer("devices", None, "Devices of the learner (1; quick 4).")
_MFU_PRESET = flags.DEFINE_string("mfu_preset", None, "MFU preset (gemma_2b; quick tiny).")
_MFU_BATCH = flags.DEFINE_integer("mfu_batch", None, "First batch tried (4; quick 4).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", None, "Largest batch tried (256; quick 16).")
_MFU_SEQ = flags.DEFINE_integer("mfu_seq_len", None, "MFU tokens per sequence (1024; quick 64).")
_MFU_STEPS = flags.DEFINE_integer("mfu_steps", None, "Timed MFU steps (10; quick 3).")
_REMAT = flags.DEFINE_list("remat", ["none", "dots", "full"], "Remat policies compared.")
_DTYPE = flags.DEFINE_string("dtype", None, "Compute dtype (bfloat16; quick float32).")
_ATTN = flags.DEFINE_enum("attention_impl", "xla", ["xla", "dot_product_attention"],
                          "model.attention_impl of the MFU runs.")  # fmt: skip
_SOFTCAP = flags.DEFINE_float(
    "attn_softcap", None, "Override model.attn_logit_softcap of the MFU runs (0: off, which "
    "the fused attention kernels need)."
)  # fmt: skip
_CHUNK = flags.DEFINE_integer(
    "logits_chunk", None, "Override model.logits_chunk of the MFU runs (0: the output layer "
    "and loss over the whole sequence at once; default: the preset's)."
)  # fmt: skip
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dd_bench_accelerator", "Run directories.")
_EMULATE = flags.DEFINE_float(
    "emulate_step_ms", 0.0, "Overhead and fleet: the learners' steps run no model; each "
    "occupies one emulated accelerator (shared) for this many ms (no CPU used), so a CPU host "
    "measures the host work of learners whose device is that fast (0: the real step)."
)  # fmt: skip

_GIL = flags.DEFINE_float(
    "gil_switch_ms", None, "Fleet: the run's gil_switch_ms (0: Python's 5 ms; default: the "
    "config's)."
)  # fmt: skip

ARMS = (
    "plain",
    "decoupled",
    "no-pipeline",
    "ckpt-duty1",
    "py-switch",
    "host-rebase",
    "syncer-proc",
)

_LOCAL_SYNCER = flags.DEFINE_enum(
    "local_syncer",
    None,
    ["thread", "process"],
    "The decoupled runs' syncer: on a thread "
    "beside the learners or in a process of its own (default: the config's, thread).",
)
_ARMS = flags.DEFINE_list(
    "arms", None, "Overhead arms to run beside plain (default: all of them), e.g. "
    "decoupled,py-switch,syncer-proc."
)  # fmt: skip
_FLEET_ARM = flags.DEFINE_enum(
    "fleet_arm", "decoupled", ARMS[1:], "Fleet: the learners' configuration, one of the "
    "overhead arms (host-rebase: rebases and outer gradients on the host)."
)  # fmt: skip


def _quick_setup() -> None:
    """XLA reads its flags when JAX starts: no CUDA graphs (`cli.xla_flags`), and --quick
    runs on 8 fake CPU devices."""
    quick = "--quick" in sys.argv or "--quick=true" in sys.argv
    cli.xla_flags(cli.CPU_DEVICES if quick else None)
    if quick:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


_quick_setup()

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from decoupled_diloco import compile_cache, models, report  # noqa: E402
from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco.mfu import largest_fitting_batch, peak_flops  # noqa: E402
from decoupled_diloco.models.config import DTYPES, REMAT_POLICIES  # noqa: E402
from decoupled_diloco.models.flops import train_flops_per_token  # noqa: E402
from decoupled_diloco.runtime.local import LocalRuntime  # noqa: E402
from decoupled_diloco.sharding import make_mesh  # noqa: E402
from decoupled_diloco.train.replica import Replica  # noqa: E402


def _pick(flag, full, quick):
    return flag.value if flag.value is not None else (quick if _QUICK.value else full)


# --- (a) learner overhead --------------------------------------------------------------------
class _Pending:
    """A metric of an emulated step: reading it waits until that step is done."""

    def __init__(self, done_at: float, value: float):
        self.done_at, self.value = done_at, value

    def __array__(self, dtype=None, copy=None):
        time.sleep(max(self.done_at - time.perf_counter(), 0.0))
        return np.asarray(self.value, dtype=dtype)


class _EmulatedDevice:
    """The one accelerator of the process: steps of every learner on it run one at a time,
    in the order they are dispatched (learners sharing a GPU, like the `mid` quality runs)."""

    def __init__(self):
        self._lock, self._free_at = threading.Lock(), 0.0

    def enqueue(self, seconds: float) -> float:
        """Queues a step of `seconds`; returns when it will be done."""
        with self._lock:
            self._free_at = max(self._free_at, time.perf_counter()) + seconds
            return self._free_at


_DEVICE = _EmulatedDevice()


class EmulatedReplica(Replica):
    """A replica whose train step is an accelerator that takes `--emulate_step_ms` per step
    and runs its queue asynchronously: `step` only enqueues (the host returns at once, as
    with a real dispatch), reading a step's metrics or `ready` waits for it, sleeping (no
    CPU). Every replica of the process enqueues on the same emulated device. Parameters stay
    what they were (no gradient), but everything the protocol does with them is real:
    fragment copies, transfers, merges applied on the device arrays. What remains is the
    learner's host work: data, boundaries, rows, the pipeline's threads and the syncer's, all
    competing for this host's cores and GIL as they would beside a real accelerator."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step_s, self._done_at, self._steps = _EMULATE.value / 1e3, 0.0, 0

    def step(self, batch) -> dict:
        if not isinstance(batch, jax.Array):
            batch = self.put_batch(batch)
        self._done_at = _DEVICE.enqueue(self._step_s)
        self._steps += 1
        loss = 3.0 / (1.0 + 0.01 * self._steps)  # finite, falling: rows look like training
        metrics = {"loss": loss, "learning_rate": 1e-3, "grad_norm": 1.0}
        return {k: _Pending(self._done_at, v) for k, v in metrics.items()}

    def ready(self) -> None:
        time.sleep(max(self._done_at - time.perf_counter(), 0.0))
        super().ready()

    def precompile(self, fragments, kinds, alpha: float, background: bool = True) -> None:
        """At once: no train step compiles here for it to overlap with, and a learner that
        waited for it at its first offers would write those steps' rows late (rates read
        off the rows would then exceed the device's)."""
        super().precompile(fragments, kinds, alpha, background=False)


def overhead_config(arm: str, preset: str, batch: int, seq_len: int, steps: int, devices: int,
                    learners: int = 1, gil_switch_ms: float | None = None):  # fmt: skip
    """`learners` learners of `preset` (one: plain), each on `devices` devices (or sharing
    them); the decoupled arms add a syncer. `gil_switch_ms`: the run's (None: the config's)."""
    multi = 1 if arm == "plain" else 2  # 2: the syncer settings of a multi-learner run
    c = config_lib.tiny_cpu_config(f"bench_{arm}", preset=preset, learners=multi,
                                   batch_size=batch, steps=steps)  # fmt: skip
    if arm != "plain":
        config_lib.set_decoupled(c)
        c.diloco.learners = learners  # (one: the syncer is its only company)
    c.data.seq_len = seq_len
    c.model.dtype = _pick(_DTYPE, "bfloat16", "float32")
    c.devices_per_learner = devices
    c.train.eval_every = 0
    c.train.eval_batches = 1  # the final evaluation only; outside the timed window
    c.train.log_every = 1
    c.train.checkpoint_every = 0
    if arm == "ckpt-duty1":
        c.diloco.syncer_checkpoint_duty = 1.0
    if gil_switch_ms is not None:
        c.gil_switch_ms = gil_switch_ms
    if _LOCAL_SYNCER.value is not None:
        c.local_syncer = _LOCAL_SYNCER.value
    if arm == "syncer-proc":
        c.local_syncer = "process"
    if arm == "py-switch":
        c.gil_switch_ms = 0.0
    if arm == "host-rebase":
        c.diloco.device_rebase = False
    if arm == "no-pipeline":
        c.train.prefetch = 0
        c.diloco.stage_merges = False
    return c


def _rows(workdir: pathlib.Path, learner: int = 0) -> list[dict]:
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return sorted(
        (r for r in rows if r.get("learner") == learner and "loss" in r), key=lambda r: r["step"]
    )


def _step_at(rows: list[dict], t: float) -> float:
    """A learner's step count at time t (within its rows), interpolated between rows."""
    times = [r["time"] for r in rows]
    return float(np.interp(t, times, [r["step"] for r in rows]))


def _rate(rows: list[dict]) -> float:
    """Steps per second between the first and the last row."""
    return (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["time"] - rows[0]["time"])


def untimed(name: str, run) -> None:
    """--warmup: `run(workdir)` once for what the process compiles, its folder then removed."""
    path, start = pathlib.Path(_WORKDIR.value) / f"{name}_warmup", time.perf_counter()
    run(path)
    shutil.rmtree(path)
    print(f"warm-up: {name} ran once untimed ({time.perf_counter() - start:.1f} s)", flush=True)


def _fresh_run(run, workdir: pathlib.Path) -> dict:
    """Runs `run` in an empty `workdir` (on the emulated device with --emulate_step_ms);
    returns its summary."""
    if workdir.exists():
        shutil.rmtree(workdir)  # a stale run would be resumed from its checkpoints
    replica = EmulatedReplica if _EMULATE.value else Replica
    return LocalRuntime(run, str(workdir), verbose=False, replica=replica).run()


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def run_overhead_arm(arm: str, workdir: pathlib.Path, skip: int, **shape) -> dict:
    summary = _fresh_run(config_lib.validate(overhead_config(arm, **shape)), workdir)
    rows = [r for r in _rows(workdir) if r["step"] >= skip]
    if len(rows) < 3:
        raise RuntimeError(f"{arm}: fewer than 3 rows after step {skip}; raise --steps")
    stage = [r["stage_ms"] for r in rows if "stage_ms" in r]
    waited = [r.get("compile_wait_s", 0.0) for r in rows]
    return {
        # Seconds the protocol's ops waited for their compile inside the timed window.
        "compile_wait": waited[-1] - waited[0],
        "steps_per_s": _rate(rows),
        "host_share": _median(rows[1:], "host_share"),
        "cpu_share": _median(rows[1:], "host_cpu_share"),
        "merges": summary.get("merges", 0),
        "deferred": rows[-1].get("merges_deferred", 0),
        "stage_ms": stage[-1] if stage else float("nan"),
    }


def overhead() -> None:
    preset = _pick(_PRESET, "mid", "tiny")
    shape = dict(
        preset=preset,
        batch=_pick(_BATCH, 32, 8),
        seq_len=_pick(_SEQ, 256, 64),
        steps=_pick(_STEPS, 200, 40),
        devices=_pick(_DEVICES, 1, 4),
    )
    skip, rounds = _pick(_SKIP, 20, 8), _pick(_ROUNDS, 3, 2)
    if skip + 5 > shape["steps"]:
        raise ValueError(f"--steps ({shape['steps']}) must exceed --skip ({skip}) by at least 5")
    tokens = shape["batch"] * shape["seq_len"]
    device = jax.devices()[0].device_kind
    if _EMULATE.value:
        device = f"emulated accelerator at {_EMULATE.value:g} ms per step, host {device}"
    print(f"\n(a) learner overhead: {preset}, {shape['batch']} x {shape['seq_len']} tokens per "
          f"step, {shape['devices']} x {device}; {rounds} rounds x {shape['steps']} steps, "
          f"first {skip} excluded", flush=True)  # fmt: skip
    print(
        f"{'round':>5} {'arm':<12} {'steps/s':>8} {'tokens/s':>10} {'host_share':>10} "
        f"{'cpu_share':>9} {'merges':>6} {'deferred':>8} {'stage_ms':>8} {'compile_s':>9}"
    )
    chosen = ARMS[1:] if _ARMS.value is None else [a for a in _ARMS.value if a != "plain"]
    chosen = list(dict.fromkeys(chosen))  # each arm once per round
    arms = ("plain", *chosen)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise ValueError(f"--arms: unknown {unknown}; the arms are {', '.join(ARMS[1:])}")
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    if _WARMUP.value:
        warm = dict(shape, steps=skip + 10)
        for arm in arms:
            untimed(arm, lambda path, arm=arm: run_overhead_arm(arm, path, skip, **warm))
    for r in range(rounds):
        for arm in arms:
            res = run_overhead_arm(arm, pathlib.Path(_WORKDIR.value) / arm, skip, **shape)
            results[arm].append(res)
            print(f"{r:>5} {arm:<12} {res['steps_per_s']:>8.2f} "
                  f"{res['steps_per_s'] * tokens:>10.0f} {res['host_share']:>10.3f} "
                  f"{res['cpu_share']:>9.3f} {res['merges']:>6} {res['deferred']:>8} "
                  f"{res['stage_ms']:>8.2f} {res['compile_wait']:>9.3f}",
                  flush=True)  # fmt: skip
    for arm in arms[1:]:
        ratios = [
            d["steps_per_s"] / p["steps_per_s"]
            for p, d in zip(results["plain"], results[arm], strict=True)
        ]
        print(f"{arm} / plain = {statistics.median(ratios):.3f} (per round "
              f"{', '.join(f'{x:.3f}' for x in ratios)}; goal >= 0.95 for decoupled)")  # fmt: skip


# --- (b) MFU and memory at the largest batch that fits ---------------------------------------
def mfu_run(preset: str, batch: int, seq_len: int, remat: str, devices: int):
    """The validated RunConfig and a Replica of one learner for an MFU measurement."""
    c = config_lib.tiny_cpu_config("bench_mfu", preset=preset, batch_size=batch)
    c.data.seq_len = seq_len
    c.model.dtype = _pick(_DTYPE, "bfloat16", "float32")
    c.model.remat = remat
    c.model.attention_impl = _ATTN.value
    if _SOFTCAP.value is not None:
        c.model.attn_logit_softcap = _SOFTCAP.value
    if _CHUNK.value is not None:
        c.model.logits_chunk = _CHUNK.value
    c.devices_per_learner = devices
    run = config_lib.validate(c)
    return run, Replica(run.model, run.train, make_mesh(jax.devices()[:devices], run.mesh))


def compiled_bytes(replica: Replica, batch: int, seq_len: int) -> int:
    """Peak bytes per device of one train step as XLA plans it (arguments + outputs +
    temporaries, less the donated state the outputs reuse), without allocating anything."""
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), np.int32, sharding=replica.batch_sharding)
    mem = replica._train_step.lower(replica.abstract_state(), tokens).compile().memory_analysis()
    if mem is None:  # a backend without the analysis
        return 0
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    return int(total - mem.alias_size_in_bytes)


def device_limit() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def largest_batch(preset, seq_len, remat, devices, first, cap) -> tuple[int, int] | None:
    """(batch, planned bytes) of the largest batch first·2^k <= cap whose step fits 95% of
    the device's memory (`mfu.largest_fitting_batch`: about three compilations)."""
    limit = device_limit()

    def plan(batch: int) -> int | None:
        try:
            _, replica = mfu_run(preset, batch, seq_len, remat, devices)
            return compiled_bytes(replica, batch, seq_len)
        except Exception as e:  # noqa: BLE001 - a compile that fails to fit is "too big"
            if "RESOURCE_EXHAUSTED" not in str(e) and "memory" not in str(e).lower():
                raise
            return None

    # memory_analysis() plans one device's share of a sharded step: against one device.
    budget = 0.95 * limit if limit is not None else float("inf")
    return largest_fitting_batch(plan, first, cap, budget)


_PEAK_SEEN = [0]  # the highest allocator peak of the MFU runs so far (bytes)


def measure_mfu(preset, batch, seq_len, remat, devices, steps) -> dict:
    run, replica = mfu_run(preset, batch, seq_len, remat, devices)
    t0 = time.perf_counter()
    replica.init_from_rng(jax.random.key(0))
    replica.ready()
    init_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = min(run.model.vocab_size, 256)
    batches = [replica.put_batch(rng.integers(0, vocab, (batch, seq_len + 1), dtype=np.int32))
               for _ in range(2)]  # fmt: skip
    t0 = time.perf_counter()
    jax.block_until_ready(replica.step(batches[0]))  # compiles
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(replica.step(batches[1]))
    t0 = time.perf_counter()
    for i in range(steps):
        metrics = replica.step(batches[i % 2])
    jax.block_until_ready((metrics, replica.state))
    step_s = (time.perf_counter() - t0) / steps
    tokens_s = batch * seq_len / step_s
    flops = train_flops_per_token(run.model, seq_len)
    peak = peak_flops(jax.devices()[0].device_kind)
    stats = jax.devices()[0].memory_stats() or {}
    # The allocator's peak is the process's (JAX cannot reset it): this run's own only if it
    # rose past the earlier runs' ("<=" that peak otherwise; the plan column is per run).
    peak_bytes = stats.get("peak_bytes_in_use", 0)
    own = peak_bytes > _PEAK_SEEN[0]
    _PEAK_SEEN[0] = max(_PEAK_SEEN[0], peak_bytes)
    return {
        "step_ms": 1e3 * step_s,
        "tokens_s": tokens_s,
        "mfu": tokens_s * flops / (devices * peak) if peak else None,
        "tflops": tokens_s * flops / devices / 1e12,
        "peak": f"{'' if own or not peak_bytes else '<='}{peak_bytes / 2**30:.2f}",
        "init_s": init_s,
        "compile_s": compile_s,
    }


def mfu() -> None:
    preset, seq_len = _pick(_MFU_PRESET, "gemma_2b", "tiny"), _pick(_MFU_SEQ, 1024, 64)
    devices, steps = _pick(_DEVICES, 1, 4), _pick(_MFU_STEPS, 10, 3)
    first, cap = _pick(_MFU_BATCH, 4, 4), _pick(_MAX_BATCH, 256, 16)
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind)
    chunk = (
        _CHUNK.value if _CHUNK.value is not None else models.get_model_config(preset).logits_chunk
    )
    print(f"\n(b) {preset}, seq_len {seq_len}, {devices} x {kind} (peak "
          f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown: no MFU'}), "
          f"attention {_ATTN.value}, logits chunk {chunk or 'off'}", flush=True)  # fmt: skip
    head = ("remat", "batch", "tokens", "plan GiB", "step ms", "tokens/s", "TFLOP/s/dev", "MFU",
            "peak GiB", "init s", "compile s")  # fmt: skip
    print("{:<6} {:>5} {:>7} {:>8} {:>8} {:>9} {:>11} {:>5} {:>8} {:>6} {:>9}".format(*head))
    for remat in _REMAT.value:
        found = largest_batch(preset, seq_len, remat, devices, first, cap)
        if found is None:
            print(f"{remat:<6} batch {first} does not fit")
            continue
        batch, need = found
        r = measure_mfu(preset, batch, seq_len, remat, devices, steps)
        mfu_text = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
        cells = (remat, batch, batch * seq_len, need / 2**30, r["step_ms"], r["tokens_s"],
                 r["tflops"], mfu_text, r["peak"], r["init_s"], r["compile_s"])  # fmt: skip
        row = "{:<6} {:>5} {:>7} {:>8.2f} {:>8.1f} {:>9.0f} {:>11.3f} {:>5} {:>8} {:>6.1f}"
        row += " {:>9.1f}"
        print(row.format(*cells), flush=True)


# --- (c) a fleet of learners sharing the device ----------------------------------------------
def fleet() -> None:
    """--learners decoupled learners on the same devices (the `mid` quality runs' setting),
    against one plain loop there: how much of the device the fleet keeps busy, and whether
    its syncer and pipelines keep up with the schedule (steps per offer near H; merges back
    within a few steps). An offer waits for its predecessor's merge, so round trips longer
    than H steps merge each fragment less often: what cost the H200's `mid` runs quality."""
    preset, learners = _pick(_PRESET, "mid", "tiny"), _LEARNERS.value
    shape = dict(preset=preset, batch=_pick(_BATCH, 32, 8), seq_len=_pick(_SEQ, 256, 64),
                 steps=_pick(_STEPS, 200, 600), devices=_pick(_DEVICES, 1, 1))  # fmt: skip
    skip = _pick(_SKIP, 20, 8)
    # Learners take disjoint devices while there are enough, then share them.
    used = min(learners * shape["devices"], jax.device_count())
    where = f"{used} x {jax.devices()[0].device_kind}"
    if _EMULATE.value:
        used = 1
        where = (f"1 emulated accelerator at {_EMULATE.value:g} ms per step, host "
                 f"{jax.devices()[0].device_kind}")  # fmt: skip
    shared = "shared" if used < learners * shape["devices"] else "not shared"
    run = config_lib.validate(
        overhead_config(_FLEET_ARM.value, learners=learners, gil_switch_ms=_GIL.value, **shape)
    )
    print(f"\n(c) fleet: {learners} {_FLEET_ARM.value} learners of {preset}, {shape['batch']} x "
          f"{shape['seq_len']} tokens per step each, {shape['devices']} device(s) each, on "
          f"{where} ({shared}); {shape['steps']} steps, first {skip} excluded; host cores "
          f"{os.cpu_count()}; thread switch interval "
          f"{_GIL.value if _GIL.value is not None else config_lib.GIL_SWITCH_MS:g} ms (0: "
          f"Python's); syncer on a {run.local_syncer}", flush=True)  # fmt: skip
    # --gil_switch_ms applies to the plain loop too: fleet / plain compares like with like.
    plain = run_overhead_arm("plain", pathlib.Path(_WORKDIR.value) / "fleet_plain", skip,
                             gil_switch_ms=_GIL.value, **shape)  # fmt: skip
    if _WARMUP.value:  # what a process compiles once, as in the overhead part
        warm = dict(shape, steps=skip + 10)
        arm = _FLEET_ARM.value
        warm_run = overhead_config(arm, learners=learners, gil_switch_ms=_GIL.value, **warm)
        untimed("fleet", lambda path: _fresh_run(config_lib.validate(warm_run), path))
    workdir = pathlib.Path(_WORKDIR.value) / "fleet"
    summary = _fresh_run(run, workdir)
    rows = [[r for r in _rows(workdir, m) if r["step"] >= skip] for m in range(learners)]
    if any(len(r) < 2 for r in rows):
        raise RuntimeError(f"a learner has fewer than 2 rows after step {skip}; raise --steps")
    # Steps each learner took in the one interval all of them were stepping (they start and
    # end at different times), read off its rows by linear interpolation.
    start = max(r[0]["time"] for r in rows)
    end = min(r[-1]["time"] for r in rows)
    if end - start <= 0:
        raise RuntimeError("the learners never stepped at the same time (one ran before the "
                           "others had compiled?); raise --steps")  # fmt: skip
    rates = [(_step_at(r, end) - _step_at(r, start)) / (end - start) for r in rows]
    delay = report.mean_merge_delay([r for rs in rows for r in rs])
    H, tau = run.diloco.sync_every, run.diloco.overlap
    total = sum(rates)
    print(f"plain loop: {plain['steps_per_s']:.2f} steps/s; fleet: {total:.2f} steps/s in all "
          f"({', '.join(f'{r:.2f}' for r in rates)} per learner)")  # fmt: skip
    print(f"fleet / plain = {total / plain['steps_per_s']:.3f} (the device's share the fleet "
          f"keeps busy; 1 when the device bounds both)")  # fmt: skip
    waited = [r[-1].get("compile_wait_s", 0.0) - r[0].get("compile_wait_s", 0.0) for r in rows]
    print(f"compile wait in the window: {', '.join(f'{w:.3f}' for w in waited)} s per learner "
          f"(the protocol's ops waiting for their background compile; --warmup)")  # fmt: skip
    host = [_median(r[1:], "host_share") for r in rows]
    cpu = [_median(r[1:], "host_cpu_share") for r in rows]
    print(f"learner threads: host_share {', '.join(f'{x:.2f}' for x in host)}; cpu_share "
          f"{', '.join(f'{x:.2f}' for x in cpu)} (plain loop: {plain['host_share']:.2f}, "
          f"{plain['cpu_share']:.2f}; the difference is time a thread was ready but not "
          f"running)")  # fmt: skip
    print(
        f"steps per offer = {summary.get('mean_offer_steps', float('nan')):.2f} (whole run; "
        f"schedule: H = {H}; more: offers waited for late merges; less: final offers)"
    )
    print(f"merge delay = {float('nan') if delay is None else delay:.2f} steps "
          f"(mean over the merges of the rows past --skip: offer to the boundary applying it; "
          f"tau = {tau} at best)")  # fmt: skip
    print(f"merges {summary.get('merges', 0)}, learners per merge "
          f"{summary.get('mean_learners_per_merge', float('nan')):.2f}")  # fmt: skip
    # Where a round trip goes: offer -> merge (the learner's outbox, the link, the syncer's
    # queue and grace) and the merge itself, in seconds and in the learners' steps; the rest
    # of the merge delay is the reply's way back and its placement on the learner.
    with open(workdir / "merges.jsonl", encoding="utf-8") as f:
        merges = [r for r in map(json.loads, f) if r.get("event") == "merge"]
    step_s = len(rates) / total if total else float("nan")  # one learner's seconds per step
    if merges:
        age = summary["mean_offer_seconds"]
        merge_s = statistics.mean(r["merge_seconds"] for r in merges)
        print(f"offer to merge = {age:.3f} s ({age / step_s:.1f} steps; outbox, link, syncer "
              f"queue and grace), merge {1e3 * merge_s:.1f} ms (means over the run's "
              f"{len(merges)} merges)")  # fmt: skip
    print(f"lock wait = {summary['lock_wait_ms']:.3f} ms (p99 {summary['lock_wait_p99_ms']:.3f} "
          f"ms; how late a thread that slept ran Python again: the threads' bursts holding "
          f"the interpreter lock, and the host's run queue; runtime/gil.py)")  # fmt: skip


def check_flags() -> None:
    """app.UsageError for flags that would fail minutes in (after the overhead part) or
    measure nothing."""
    bad = [r for r in _REMAT.value if r not in REMAT_POLICIES]
    if bad or not _REMAT.value:
        raise app.UsageError(f"--remat={','.join(_REMAT.value)}: each one of "
                             f"{REMAT_POLICIES}")  # fmt: skip
    if _DTYPE.value is not None and _DTYPE.value not in DTYPES:
        raise app.UsageError(f"--dtype={_DTYPE.value}: one of {DTYPES}")
    sizes = (_LEARNERS, _BATCH, _SEQ, _STEPS, _ROUNDS, _DEVICES, _MFU_BATCH, _MAX_BATCH,
             _MFU_SEQ, _MFU_STEPS)  # fmt: skip
    for flag in sizes:
        if flag.value is not None and flag.value < 1:
            raise app.UsageError(f"--{flag.name}={flag.value}: must be >= 1")
    if _SKIP.value is not None and _SKIP.value < 0:
        raise app.UsageError(f"--skip={_SKIP.value}: must be >= 0")
    first, cap = _pick(_MFU_BATCH, 4, 4), _pick(_MAX_BATCH, 256, 16)
    if cap < first:
        raise app.UsageError(f"--max_batch={cap} is below the first batch tried, {first} "
                             "(--mfu_batch)")  # fmt: skip


def main(argv):
    del argv
    check_flags()
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    compile_cache.enable()
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
          f"({jax.default_backend()}); load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    if _PART.value in ("all", "overhead"):
        overhead()
    if _PART.value in ("all", "mfu"):
        mfu()
    if _PART.value == "fleet":
        fleet()


if __name__ == "__main__":
    cli.run_script(main)
