r"""Learners at accelerator speed: learner overhead, and MFU / memory of a preset.

    python scripts/bench_accelerator.py                  # on the machine's accelerator(s)
    python scripts/bench_accelerator.py --quick          # 8 fake CPU devices, tiny model, ~3 min
    python scripts/bench_accelerator.py --part=overhead  # or --part=mfu

(a) Learner overhead, side by side in one run, rounds alternating the arms so a busy
    machine skews them alike. Every arm is one learner on the same devices, model and batch
    (default: the `mid` preset, 32 x 256 tokens per step, the shape of the quality issue):
      plain        sync_every=0: a plain training loop
      decoupled    the same learner inside Decoupled DiLoCo (tiny_decoupled's syncer
                   settings: H 12, P 6, tau 2, K 1, RDA), its syncer a thread of this process
      no-pipeline  decoupled with train.prefetch=0 and diloco.stage_merges=False: data read
                   and merges computed on the learner's thread (what the pipeline buys)
    Rates come from the runs' metrics rows (log_every=1): steps per second between the row
    at --skip (compilation excluded) and the last one. Prints decoupled / plain (goal >= 0.95)
    and the learner's host_share (the share of its step the learner thread spent on host work
    instead of waiting for the device: near 1, the device starves).
(b) MFU and peak memory of --mfu_preset at the largest batch that fits, for each remat
    policy (--remat): the batch doubles from --mfu_batch until the compiled step's memory
    (`memory_analysis()`) no longer fits the device (or --max_batch), then the largest that
    fit runs --mfu_steps timed steps. MFU = model FLOPs/token x tokens/s / (devices x peak);
    blank where the device's peak is unknown (CPU).
"""

import json
import os
import pathlib
import shutil
import statistics
import sys

from absl import app, flags, logging

_QUICK = flags.DEFINE_bool("quick", False, "Fake CPU devices, tiny model, short runs (~3 min).")
_PART = flags.DEFINE_enum("part", "all", ["all", "overhead", "mfu"], "Which measurement.")
_PRESET = flags.DEFINE_string("preset", None, "Overhead model preset (default mid; quick tiny).")
_BATCH = flags.DEFINE_integer("batch", None, "Overhead sequences per step (32; quick 8).")
_SEQ = flags.DEFINE_integer("seq_len", None, "Tokens per sequence (256; quick 64).")
_STEPS = flags.DEFINE_integer("steps", None, "Steps per overhead run (200; quick 40).")
_SKIP = flags.DEFINE_integer("skip", None, "Leading steps excluded (20; quick 8).")
_ROUNDS = flags.DEFINE_integer("rounds", None, "Rounds of all overhead arms (3; quick 2).")
_DEVICES = flags.DEFINE_integer("devices", None, "Devices of the learner (1; quick 4).")
_MFU_PRESET = flags.DEFINE_string("mfu_preset", None, "MFU preset (gemma_2b; quick tiny).")
_MFU_BATCH = flags.DEFINE_integer("mfu_batch", None, "First batch tried (4; quick 4).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", None, "Largest batch tried (256; quick 16).")
_MFU_SEQ = flags.DEFINE_integer("mfu_seq_len", None, "MFU tokens per sequence (1024; quick 64).")
_MFU_STEPS = flags.DEFINE_integer("mfu_steps", None, "Timed MFU steps (10; quick 3).")
_REMAT = flags.DEFINE_list("remat", ["none", "dots", "full"], "Remat policies compared.")
_DTYPE = flags.DEFINE_string("dtype", None, "Compute dtype (bfloat16; quick float32).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dd_bench_accelerator", "Run directories.")

ARMS = ("plain", "decoupled", "no-pipeline")


def _quick_setup() -> None:
    """--quick runs on 8 fake CPU devices: XLA reads the flag when JAX starts."""
    if "--quick" in sys.argv or "--quick=true" in sys.argv:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


_quick_setup()

import jax  # noqa: E402

from decoupled_diloco import compile_cache  # noqa: E402
from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco.runtime.local import LocalRuntime  # noqa: E402


def _pick(flag, full, quick):
    return flag.value if flag.value is not None else (quick if _QUICK.value else full)


# --- (a) learner overhead --------------------------------------------------------------------
def overhead_config(arm: str, preset: str, batch: int, seq_len: int, steps: int, devices: int):
    """One learner of `preset` on `devices` devices; the decoupled arms add a syncer."""
    learners = 1 if arm == "plain" else 2  # 2: the syncer settings of a multi-learner run
    c = config_lib.tiny_cpu_config(f"bench_{arm}", preset=preset, learners=learners,
                                   batch_size=batch, steps=steps)  # fmt: skip
    if arm != "plain":
        config_lib.set_decoupled(c)
        c.diloco.learners = 1  # one learner: the syncer is its only company
    c.data.seq_len = seq_len
    c.model.dtype = _pick(_DTYPE, "bfloat16", "float32")
    c.devices_per_learner = devices
    c.train.eval_every = 0
    c.train.eval_batches = 1  # the final evaluation only; outside the timed window
    c.train.log_every = 1
    c.train.checkpoint_every = 0
    if arm == "no-pipeline":
        c.train.prefetch = 0
        c.diloco.stage_merges = False
    return c


def _rows(workdir: pathlib.Path) -> list[dict]:
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return sorted(
        (r for r in rows if r.get("learner") == 0 and "loss" in r), key=lambda r: r["step"]
    )


def run_overhead_arm(arm: str, workdir: pathlib.Path, skip: int, **shape) -> dict:
    if workdir.exists():
        shutil.rmtree(workdir)  # a stale run would be resumed from its checkpoints
    run = config_lib.validate(overhead_config(arm, **shape))
    summary = LocalRuntime(run, str(workdir), verbose=False).run()
    rows = [r for r in _rows(workdir) if r["step"] >= skip]
    if len(rows) < 3:
        raise RuntimeError(f"{arm}: fewer than 3 rows after step {skip}; raise --steps")
    (s0, t0), (s1, t1) = (rows[0]["step"], rows[0]["time"]), (rows[-1]["step"], rows[-1]["time"])
    shares = [r["host_share"] for r in rows[1:] if "host_share" in r]
    return {
        "steps_per_s": (s1 - s0) / (t1 - t0),
        "host_share": statistics.median(shares) if shares else float("nan"),
        "merges": summary.get("merges", 0),
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
    print(f"\n(a) learner overhead: {preset}, {shape['batch']} x {shape['seq_len']} tokens per "
          f"step, {shape['devices']} x {jax.devices()[0].device_kind}; {rounds} rounds x "
          f"{shape['steps']} steps, first {skip} excluded", flush=True)  # fmt: skip
    print(
        f"{'round':>5} {'arm':<12} {'steps/s':>8} {'tokens/s':>10} {'host_share':>10} {'merges':>6}"
    )
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in ARMS:
            res = run_overhead_arm(arm, pathlib.Path(_WORKDIR.value) / arm, skip, **shape)
            results[arm].append(res)
            print(f"{r:>5} {arm:<12} {res['steps_per_s']:>8.2f} "
                  f"{res['steps_per_s'] * tokens:>10.0f} {res['host_share']:>10.3f} "
                  f"{res['merges']:>6}", flush=True)  # fmt: skip
    for arm in ARMS[1:]:
        ratios = [
            d["steps_per_s"] / p["steps_per_s"]
            for p, d in zip(results["plain"], results[arm], strict=True)
        ]
        print(f"{arm} / plain = {statistics.median(ratios):.3f} (per round "
              f"{', '.join(f'{x:.3f}' for x in ratios)}; goal >= 0.95 for decoupled)")  # fmt: skip


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    compile_cache.enable()
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
          f"({jax.default_backend()}); load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    if _PART.value in ("all", "overhead"):
        overhead()


if __name__ == "__main__":
    app.run(main)
