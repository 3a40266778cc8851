"""An arm's run config at CPU or TPU scale, for one length mode (smoke, quick, full) and seed.

CPU scale: the arm's configs/ file, then the mode's lengths (the arm's own overrides win over
quick/full lengths; smoke lengths win over everything), then --set. Every arm is evaluated on
the same held-out sequences: eval_batches = EVAL_SEQUENCES[mode] // the learner's batch (the
runtime's Evaluator reads eval_batches x batch_size windows, in an order fixed for every seed).

TPU scale: the family's TPU config (configs/tpu_dense_multislice.py, configs/tpu_moe_v5p.py)
keeps its model, data, train.* (lr, steps, eval set), H, outer lr and momentum with the mixing
α that goes with them (README, "How outer lr and momentum relate to M, K, P and H"),
max_grace and heartbeat. The arm contributes only what defines its ablation:
  - the diloco.* and faults.* keys its overrides set, and those in which its CPU config
    differs from its family's CPU Decoupled reference (configs/tiny_decoupled.py,
    configs/tiny_moe_decoupled.py), e.g. quorum, max_wait, merge rule, compression, P = 1
    for DiLoCo, learners, the fault schedule;
  - its per-learner batch relative to that reference's, so total-batch splits carry over
    (DP with 4x the CPU batch gets 4x the TPU batch; M = 8 learners half of it).
A data-parallel arm (no syncer) becomes one learner over all devices on the local runtime.
Fault times are wall-clock seconds picked for CPU runs (joins at 20 s, 20 min chip MTBF):
rescale them with --set for TPU step times.
"""

import dataclasses
import importlib.util
import math
import pathlib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
TPU_BASE = {"dense": "tpu_dense_multislice", "moe": "tpu_moe_v5p"}
CPU_REFERENCE = {"dense": "tiny_decoupled", "moe": "tiny_moe_decoupled"}
# Scale settings the TPU config keeps even where an arm's CPU config differs.
TPU_KEEPS = {
    "diloco": ("sync_every", "outer_lr", "outer_momentum", "alpha", "max_grace",
               "heartbeat_timeout", "syncer_checkpoint_seconds"),
    "faults": ("seed",),
}  # fmt: skip

# Lengths per mode (dotted keys). Quick: minutes per experiment; full: the measured tables.
FULL = {
    "train.steps": 200,
    "train.warmup_steps": 20,
    "train.eval_every": 40,
    "train.batch_size": 16,  # per learner: M = 4 learners see 64 sequences per step
}
QUICK = {
    "train.steps": 48,
    "train.warmup_steps": 5,
    "train.eval_every": 16,
    "train.batch_size": 8,
}
SMOKE = {
    "train.steps": 6,
    "train.batch_size": 8,
    "train.warmup_steps": 1,
    "train.eval_every": 3,
    "train.log_every": 1,
    "data.seq_len": 64,
    "data.max_corpus_bytes": 400_000,
}
# The quality ladder's lengths (experiments/quality_ladder.py, quality_targets.py): 300
# steps, enough for the asynchrony's cost to show at the tiny CPU scale.
LADDER_FULL = {"train.steps": 300, "train.warmup_steps": 30, "train.eval_every": 100,
               "train.batch_size": 16}  # fmt: skip
LADDER_QUICK = {"train.steps": 120, "train.warmup_steps": 12, "train.eval_every": 40,
                "train.batch_size": 8}  # fmt: skip
# Held-out sequences every arm is scored on (a multiple of every arm's per-learner batch).
EVAL_SEQUENCES = {"full": 256, "quick": 64, "smoke": 16}
# The `mid` scale (--scale=mid): the 31M-parameter model of the quality issue, 32 x 256
# tokens per learner and step (per-learner batches scale with the arm's batch relative to
# the CPU mode's 16 / 8), inner lr 0.012 with 10% warmup, every learner on one device
# (several share a GPU). Lengths per mode; eval on 256 held-out sequences.
MID = {
    "model.preset": "mid",
    "data.seq_len": 256,
    "devices_per_learner": 1,
    "train.learning_rate": 0.012,
}
MID_LENGTHS = {
    "full": {"train.steps": 1000, "train.warmup_steps": 100, "train.eval_every": 250},
    "quick": {"train.steps": 300, "train.warmup_steps": 30, "train.eval_every": 100},
    "smoke": {"train.steps": 6, "train.warmup_steps": 1, "train.eval_every": 3},
}
MID_BATCH = 32  # sequences per learner and step for the CPU mode's per-learner batch
# TPU scale keeps its config's train.* in full mode; quick and smoke only shorten the run.
TPU_LENGTHS = {
    "full": {},
    "quick": {"train.steps": 2000, "train.warmup_steps": 200, "train.eval_every": 500,
              "train.checkpoint_every": 500},
    "smoke": {"train.steps": 48, "train.warmup_steps": 4, "train.eval_every": 24,
              "train.checkpoint_every": 0},
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Arm:
    """One setting of an experiment: `config` is a configs/ file (optionally `file:arg`)."""

    name: str
    config: str
    overrides: dict = dataclasses.field(default_factory=dict)
    label: str = ""
    model: str = "dense"  # model family: "dense" | "moe" (picks the TPU config and reference)


def load_config(spec: str):
    """`tiny_decoupled` or `heterogeneous:sync` -> that configs/ file's get_config(arg)."""
    name, _, arg = spec.partition(":")
    path = CONFIG_DIR / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"dd_config_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def shipped_outer_lr() -> float:
    """configs/tiny_decoupled.py's outer lr (its momentum is 0): the step every decoupled
    config ships with (`set_decoupled`)."""
    return load_config("tiny_decoupled").diloco.outer_lr


def set_key(c, key: str, value) -> None:
    *path, last = key.split(".")
    node = c
    for p in path:
        node = node[p]
    node[last] = value


# The keys `_finish` sets for every arm and seed, with where to set them instead: an override
# of one (--set) would be replaced without a word, while the table's note still named it.
SET_PER_RUN = {
    "name": "each run is named <arm>_s<seed>",
    "seed": "give the seeds with --seeds",
    "data.seed": "give the seeds with --seeds",
    "faults.seed": "give the seeds with --seeds (the arms of a seed share its faults)",
    "train.eval_batches": "every arm is scored on the same EVAL_SEQUENCES of its mode",
}


def _finish(c, name: str, seed: int, eval_sequences: int) -> None:
    """Seeds, eval set size, and the rules every arm shares."""
    c.name = name
    c.seed = seed
    c.data.seed = seed
    c.faults.seed = seed  # arms of one seed share the fault schedule (same crash times)
    batch = c.train.batch_size
    if eval_sequences % batch:
        raise ValueError(
            f"{name}: per-learner batch {batch} does not divide the {eval_sequences} eval "
            "sequences shared by every arm"
        )
    c.train.eval_batches = eval_sequences // batch
    if c.train.eval_every:  # data-parallel learners evaluate only on their logged steps
        c.train.log_every = math.gcd(c.train.log_every, c.train.eval_every)
    crashes = c.faults.chip_mtbf_hours > 0 or len(c.faults.crashes) > 0
    if c.diloco.sync_every or not crashes:
        c.train.checkpoint_every = 0  # only a crashed DP job restores from checkpoints
    if c.diloco.sync_every:  # a sync period longer than the run would never merge mid-run
        h = min(c.diloco.sync_every, c.train.steps)
        c.diloco.sync_every = h
        c.diloco.fragments = min(c.diloco.fragments, h)
        c.diloco.overlap = min(c.diloco.overlap, h - 1)


def cpu_config(arm, seed: int, mode: str, length: dict, extra: dict):
    """The arm's CPU ConfigDict; `length` = the script's overrides for `mode`."""
    c = load_config(arm.config)
    over = (arm.overrides | length) if mode == "smoke" else (length | arm.overrides)
    for key, value in (over | extra).items():
        set_key(c, key, value)
    _finish(c, f"{arm.name}_s{seed}", seed, EVAL_SEQUENCES[mode])
    return c


def ablation(cpu, reference, explicit=()) -> dict:
    """diloco.* / faults.* settings in which `cpu` differs from its family's reference, plus
    those the arm sets explicitly (`explicit` dotted keys: γ = 1 stays γ = 1 on TPU even
    where the CPU reference has it too)."""
    out = {}
    for section, keeps in TPU_KEEPS.items():
        for key, value in cpu[section].items():
            differs = value != reference[section].get(key)
            if key not in keeps and (differs or f"{section}.{key}" in explicit):
                out[f"{section}.{key}"] = value
    if not cpu.diloco.sync_every:
        out["diloco.sync_every"] = 0  # data-parallel: no syncer
    return out


def tpu_config(arm, seed: int, mode: str, length: dict, extra: dict):
    """The arm's TPU ConfigDict: its family's TPU config plus the arm's ablation settings."""
    cpu = cpu_config(arm, seed, mode, length, {})
    ref = cpu_config(Arm("reference", CPU_REFERENCE[arm.model]), seed, mode, length, {})
    c = load_config(TPU_BASE[arm.model])
    eval_sequences = c.train.eval_batches * c.train.batch_size
    for key, value in ablation(cpu, ref, arm.overrides).items():
        set_key(c, key, value)
    share = cpu.train.batch_size / ref.train.batch_size
    c.train.batch_size = max(round(c.train.batch_size * share), 1)
    if not c.diloco.sync_every:
        c.runtime = "local"  # the Ray runtime runs learners against a syncer
    for key, value in (TPU_LENGTHS[mode] | extra).items():
        set_key(c, key, value)
    _finish(c, f"{arm.name}_s{seed}", seed, eval_sequences)
    return c


def mid_config(arm, seed: int, mode: str, length: dict, extra: dict):
    """The arm's CPU config moved to the `mid` scale: model, sequence length and lengths
    from MID, per-learner batch scaled so the CPU mode's batch becomes MID_BATCH."""
    c = cpu_config(arm, seed, mode, length, {})
    base = (SMOKE if mode == "smoke" else length).get("train.batch_size", FULL["train.batch_size"])
    batch = max(round(c.train.batch_size * MID_BATCH / base), 1)
    for key, value in (MID | MID_LENGTHS[mode] | {"train.batch_size": batch} | extra).items():
        set_key(c, key, value)
    _finish(c, f"{arm.name}_s{seed}", seed, 256)
    return c


def build_config(arm, seed: int, scale: str, mode: str, length: dict, extra: dict | None = None):
    """The arm's ConfigDict (not yet validated) for one seed, scale and length mode."""
    build = {"tpu": tpu_config, "mid": mid_config}.get(scale, cpu_config)
    return build(arm, seed, mode, length, extra or {})


def for_cpu_validation(c, device_count: int):
    """A copy of a TPU-scale config whose mesh fits `device_count` fake CPU devices.

    Everything but the device layout (model, data, train, diloco, faults, ray) is then checked
    by decoupled_diloco.config.validate on this machine.
    """
    c = c.copy_and_resolve_references()
    m = c.diloco.learners
    c.devices_per_learner = max(device_count // m, 1)
    c.mesh.expert = 1
    c.mesh.fsdp = 1
    c.mesh.data = -1
    if c.train.batch_size % c.devices_per_learner:
        c.devices_per_learner = 1
    c.ray.checkpoint_dir = c.ray.checkpoint_dir or "gs://bucket/checkpoints"  # set at launch
    return c
