"""The run configuration: one commented ml_collections default, validated once into dataclasses.

Config files under `configs/` start from `default_config()` and override what they need;
absl flags override any key (`--config.diloco.learners=8`). `validate()` turns the
ConfigDict into frozen dataclasses at the entry point, so bad configs fail at start-up with
the offending key in the message, and nothing deeper in the code reads a ConfigDict.
"""

import dataclasses
import math
import typing

import ml_collections

from decoupled_diloco import faults, models, sharding
from decoupled_diloco.data import DataConfig, validate_data_config
from decoupled_diloco.diloco.learner import LearnerConfig
from decoupled_diloco.diloco.syncer import SyncerConfig
from decoupled_diloco.runtime.ray_cluster import RayConfig
from decoupled_diloco.train.optimizer import TrainConfig

RUNTIMES = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, validated."""

    model: models.ModelConfig
    data: DataConfig
    train: TrainConfig
    mesh: sharding.MeshConfig
    learner: LearnerConfig
    syncer: SyncerConfig
    faults: faults.FaultSpec
    num_learners: int
    devices_per_learner: int
    runtime: str
    name: str
    ray: RayConfig = RayConfig()  # only read by runtime == "ray"

    @property
    def uses_syncer(self) -> bool:
        return self.learner.sync_every > 0


def _placeholders(dc) -> ml_collections.ConfigDict:
    """One `None` placeholder per dataclass field ("take the preset's value"), typed for absl."""
    out = ml_collections.ConfigDict()
    hints = typing.get_type_hints(dc)
    for f in dataclasses.fields(dc):
        t = hints[f.name]
        t = tuple if typing.get_origin(t) is tuple else t
        out[f.name] = ml_collections.FieldReference(None, field_type=t)
    return out


def default_config() -> ml_collections.ConfigDict:
    """Defaults of every key, each with its unit or allowed values."""
    c = ml_collections.ConfigDict()
    c.name = "run"  # free-form run name, written to summary.json
    c.runtime = "local"  # "local" (threads in one process) | "ray" (one actor per learner)
    c.seed = 0  # seeds params, data order and fault schedule unless those set their own

    # Model: a preset name plus optional per-field overrides; None = the preset's value.
    # Fields are documented in decoupled_diloco/models/config.py (ModelConfig).
    c.model = _placeholders(models.ModelConfig)
    c.model.preset = "tiny"  # a key of models.PRESETS: tiny, tiny_moe, gemma_2b, gemma_5b, ...

    c.data = ml_collections.ConfigDict(dataclasses.asdict(DataConfig()))
    # Fields documented in decoupled_diloco/data/config.py (DataConfig): source ("stdlib" |
    # "shakespeare" | "path" | "tfds"), path, tfds_*, tokenizer ("byte" | "sentencepiece"),
    # seq_len (tokens per example), eval_fraction (held-out share), max_corpus_bytes (0 = all).

    c.train = ml_collections.ConfigDict()
    c.train.steps = 200  # inner steps per learner
    c.train.batch_size = 32  # sequences per inner step per learner
    c.train.learning_rate = 3e-3  # peak inner AdamW lr
    c.train.warmup_steps = 20  # linear warmup steps
    c.train.min_lr_ratio = 0.1  # cosine decays to this fraction of the peak lr
    c.train.weight_decay = 0.1  # decoupled AdamW weight decay (matrices only)
    c.train.b1 = 0.9  # Adam beta1
    c.train.b2 = 0.95  # Adam beta2
    c.train.eps = 1e-8  # Adam epsilon
    c.train.grad_clip = 1.0  # global-norm clipping; 0 disables
    c.train.eval_every = 50  # steps between evaluations; 0 = only at the end
    c.train.eval_batches = 8  # held-out batches per evaluation
    c.train.log_every = 10  # steps between metrics.jsonl lines / progress updates
    c.train.checkpoint_every = 100  # steps between orbax checkpoints; 0 = only at the end
    c.train.uptime_window = 2.0  # seconds: uptime counts windows in which the model advanced

    c.mesh = ml_collections.ConfigDict()  # each learner's own mesh; -1 = remaining devices
    c.mesh.data = -1  # pure data-parallel axis
    c.mesh.fsdp = 1  # parameter-sharded data-parallel axis
    c.mesh.tensor = 1  # tensor-parallel axis (heads, ffw hidden, vocab)
    c.mesh.expert = 1  # expert-parallel axis (MoE)
    c.devices_per_learner = 0  # devices in each learner's mesh; 0 = all devices / learners

    c.diloco = ml_collections.ConfigDict()
    c.diloco.learners = 1  # M: independent learners (disjoint device subsets, data shards)
    c.diloco.sync_every = 0  # H: steps between two syncs of a fragment; 0 = no syncer (DP)
    c.diloco.fragments = 1  # P: parameter fragments synced on staggered schedules
    c.diloco.fragment_strategy = "balanced"  # "balanced" | "layer" | "tensor"
    c.diloco.overlap = 0  # tau: steps between offering a fragment and applying its merge
    c.diloco.alpha = 0.0  # theta <- alpha*theta + (1-alpha)*merged; 0 overwrites
    # How a learner applies a merged fragment: "rebase" keeps its work the merge does not
    # hold (steps since its offer; all of it if the round closed without it); "overwrite"
    # replaces the fragment (Streaming DiLoCo). See decoupled_diloco/diloco/learner.py.
    c.diloco.apply = "rebase"
    c.diloco.max_wait = 0.0  # seconds a learner waits at t+tau for a late merge; -1 = forever
    c.diloco.quorum = 1  # K: fresh offers needed before a fragment may merge
    # "scheduled": one round per fragment per schedule slot, late offers join the next one;
    # "eager": any K pending offers merge (ablation). See decoupled_diloco/diloco/syncer.py.
    c.diloco.rounds = "scheduled"
    c.diloco.grace_gamma = 0.5  # gamma of the adaptive grace window; 0 disables grace
    c.diloco.max_grace = 2.0  # seconds: cap of the grace window
    c.diloco.weights = "tokens"  # "tokens" (c_tokens^2 / c_steps) | "uniform"
    c.diloco.merge = "rda"  # "rda" (radial-directional) | "mean" for non-embedding fragments
    c.diloco.embedding_merge = "mean"  # merge rule of the embedding fragment: "mean" | "rda"
    c.diloco.outer_lr = 0.7  # outer Nesterov lr (DiLoCo: 0.7; Streaming DiLoCo: 0.4)
    c.diloco.outer_momentum = 0.9  # outer momentum mu
    c.diloco.nesterov = True  # Nesterov (True) or heavy-ball (False) outer momentum
    # Wire format of offers (outer gradients): none | bf16 | int8 | int4 | int2 | int1.
    c.diloco.compression = "none"
    # Wire format of replies (merged parameters, not gradients: lossy formats perturb the
    # model itself, so the default stays lossless): none | bf16 | int8 | int4 | int2 | int1.
    c.diloco.reply_compression = "none"
    # Offers whose base is more than this many versions old are rejected. With K=1 every
    # learner's offer can bump a fragment's version, so a healthy learner is routinely
    # M-1 versions behind; outer gradients are anchored on each offer's own base version,
    # so staleness is safe for the math and the bound only guards against zombies.
    c.diloco.max_staleness = 64
    # Seconds of silence before a learner counts as dead. Generous: the first step of an
    # incarnation includes XLA compilation, minutes for large models.
    c.diloco.heartbeat_timeout = 300.0
    # Seconds between the syncer's orbax checkpoints (both runtimes): a syncer crash loses
    # the merges since the last one.
    c.diloco.syncer_checkpoint_seconds = 5.0
    c.diloco.syncer_shards = 1  # S: syncer shards, each owning a subset of fragments
    c.diloco.final_sync = True  # at the end every learner offers every fragment once more

    # Fault injection (decoupled_diloco/faults.py FaultSpec); times in seconds of wall time.
    c.faults = ml_collections.ConfigDict(
        {
            f.name: (list(v) if isinstance(v, tuple) else v)
            for f in dataclasses.fields(faults.FaultSpec)
            for v in [f.default]
        }
    )

    # The Ray runtime (runtime = "ray"); fields documented in runtime/ray_cluster.py RayConfig.
    c.ray = ml_collections.ConfigDict()
    c.ray.address = ""  # "" = start (and stop) a local Ray cluster; "auto" | "host:port" joins one
    c.ray.max_restarts = 3  # times Ray restarts a dead learner / syncer process; -1 = unlimited
    c.ray.accelerator = "cpu"  # "cpu": own fake CPU devices per learner; "tpu": a slice each
    c.ray.num_cpus = 0  # CPUs a local cluster advertises; 0 = all of this machine's
    c.ray.temp_dir = "/tmp/ray_dd"  # local cluster's session dir (short: Ray's socket paths)
    c.ray.checkpoint_dir = ""  # "" = <workdir>/checkpoints; multi-node: reachable by every node
    c.ray.poll_seconds = 0.5  # seconds between the driver's collections of rows and records
    # Who evaluates Θ: "driver" (its own devices; fine on CPU) | "learner" (the lowest live
    # learner, on its slice, between two of its steps: for TPU) | "off".
    c.ray.evaluate = "driver"
    return c


def _dataclass_from(dc, section: ml_collections.ConfigDict, prefix: str, **extra):
    known = {f.name for f in dataclasses.fields(dc)}
    values = {}
    for k, v in section.items():
        if k not in known:
            raise ValueError(f"{prefix}.{k} is not a known key (known: {sorted(known)})")
        if isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        values[k] = v
    values.update(extra)
    return dc(**values)


def tiny_cpu_config(
    name: str, *, preset: str = "tiny", learners: int = 1, batch_size: int = 32, steps: int = 300
) -> ml_collections.ConfigDict:
    """The shared base of the CPU configs under configs/: tiny model, stdlib corpus.

    One learner is plain data-parallel training (no syncer). Several learners get the DiLoCo
    family's common settings: H = 12, P = 6 balanced fragments, and an outer step of plain
    averaging. DiLoCo's outer lr 0.7 with Nesterov momentum 0.9 overshoots when a run has
    only ~25 outer steps per fragment (300 steps, H = 12). Measured at 300 steps, seed 0,
    eval loss (DP at batch 128: 1.651; one learner alone: 1.854): DiLoCo 2.171 (0.7, 0.9),
    1.937 (1.0, 0.5), 1.818 (1.0, 0); Decoupled DiLoCo 2.254, 2.045, 1.834
    (experiments/README.md, experiment 1). The code defaults stay DiLoCo's, for long runs.
    """
    c = default_config()
    c.name = name
    c.model.preset = preset
    c.data.source = "stdlib"
    c.data.seq_len = 128
    c.train.steps = steps
    c.train.batch_size = batch_size  # per learner
    # Peak inner lr. These runs are short (a few hundred steps), so progress is limited by
    # step size: a sweep at 200 steps x 64 sequences (seed 0; experiments/README.md,
    # experiment 1) gave DP 2.04 / 1.88 / 1.79 / 1.74 and synchronous DiLoCo (M = 4)
    # 2.23 / 2.08 / 1.98 / 2.02 nats/byte at lr 0.003 / 0.006 / 0.012 / 0.024.
    c.train.learning_rate = 0.012
    c.train.warmup_steps = max(steps // 10, 1)
    c.train.eval_every = max(steps // 3, 1)
    c.diloco.learners = learners
    if learners == 1:
        c.diloco.sync_every = 0  # no syncer: plain data-parallel training over all devices
        return c
    c.diloco.sync_every = 12  # H
    c.diloco.fragments = 6  # P: a fragment due every H/P = 2 steps
    c.diloco.fragment_strategy = "balanced"
    c.diloco.outer_lr = 1.0
    c.diloco.outer_momentum = 0.0
    return c


def set_decoupled(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Decoupled DiLoCo's knobs (the paper's K = 1, tau = 2) on a multi-learner config.

    Grace may use the whole tau-step budget (gamma 1) and its cap must not bind: learners
    drift a step or more apart (seconds on a busy CPU); with a 1 s cap most merges held one
    learner at 100 steps (experiments/README.md, experiment 1).
    """
    c.diloco.overlap = 2  # tau (paper: 2)
    c.diloco.quorum = 1  # K (paper: 1)
    c.diloco.grace_gamma = 1.0
    c.diloco.max_grace = 4.0  # seconds
    c.diloco.max_wait = 0.0  # never wait for the syncer
    c.diloco.weights = "tokens"
    c.diloco.merge = "rda"
    c.diloco.embedding_merge = "mean"
    return c


def validate(c: ml_collections.ConfigDict) -> RunConfig:
    """Checks every section and returns the frozen RunConfig; ValueError names the key."""
    import jax

    if c.runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {c.runtime!r}")

    model_over = {k: v for k, v in c.model.items() if k != "preset" and v is not None}
    if isinstance(model_over.get("attention_pattern"), list):
        model_over["attention_pattern"] = tuple(model_over["attention_pattern"])
    model_cfg = models.get_model_config(c.model.preset, **model_over)
    models.validate_model_config(model_cfg)

    data_cfg = _dataclass_from(DataConfig, c.data, "data")
    validate_data_config(data_cfg)
    if model_cfg.vocab_size < _vocab(data_cfg):
        raise ValueError(
            f"model.vocab_size ({model_cfg.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({_vocab(data_cfg)})"
        )

    train_cfg = _dataclass_from(TrainConfig, c.train, "train", seed=c.seed)
    for key in ("steps", "batch_size"):
        if getattr(train_cfg, key) < 1:
            raise ValueError(f"train.{key} must be >= 1, got {getattr(train_cfg, key)}")
    if train_cfg.learning_rate <= 0:
        raise ValueError(f"train.learning_rate must be > 0, got {train_cfg.learning_rate}")

    d = c.diloco
    m = d.learners
    if m < 1:
        raise ValueError(f"diloco.learners must be >= 1, got {m}")
    n_dev = jax.device_count()
    # Ray learners own devices in their own processes (a TPU slice each), not the driver's.
    if c.devices_per_learner < 0 or (c.runtime == "local" and c.devices_per_learner > n_dev):
        raise ValueError(
            f"devices_per_learner must be in [0, {n_dev}] (0 = all devices / learners), "
            f"got {c.devices_per_learner}"
        )
    per = c.devices_per_learner or n_dev // m
    if per < 1:
        raise ValueError(
            f"diloco.learners ({m}) exceeds the {n_dev} available devices; set "
            "devices_per_learner (learners then share devices round-robin)"
        )
    mesh_cfg = _dataclass_from(sharding.MeshConfig, c.mesh, "mesh")
    shape = sharding.mesh_shape(mesh_cfg, per)
    batch_ways = math.prod(
        s for a, s in zip(sharding.MESH_AXES, shape, strict=True) if a != "tensor"
    )
    if train_cfg.batch_size % batch_ways:
        raise ValueError(
            f"train.batch_size ({train_cfg.batch_size}) must be divisible by the learner's "
            f"batch-parallel devices ({batch_ways} = mesh data*fsdp*expert)"
        )

    learner_cfg = LearnerConfig(
        sync_every=d.sync_every,
        overlap=d.overlap,
        alpha=d.alpha,
        apply=d.apply,
        max_wait=math.inf if d.max_wait < 0 else d.max_wait,
        compression=d.compression,
        final_sync=d.final_sync,
    )
    syncer_cfg = SyncerConfig(
        num_fragments=d.fragments,
        fragment_strategy=d.fragment_strategy,
        quorum=d.quorum,
        rounds=d.rounds,
        drop_superseded=d.apply == "rebase",
        grace_gamma=d.grace_gamma,
        max_grace=d.max_grace,
        overlap=d.overlap,
        weights=d.weights,
        merge=d.merge,
        embedding_merge=d.embedding_merge,
        outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum,
        nesterov=d.nesterov,
        compression=d.reply_compression,
        max_staleness=d.max_staleness,
        heartbeat_timeout=d.heartbeat_timeout,
        shards=d.syncer_shards,
        checkpoint_seconds=d.syncer_checkpoint_seconds,
    )
    learner_cfg.validate()
    syncer_cfg.validate(num_learners=m)
    if learner_cfg.sync_every == 0 and m > 1:
        raise ValueError(
            f"diloco.sync_every=0 (no syncer) needs diloco.learners=1, got {m}: independent "
            "learners that never sync would train M separate models"
        )

    fault_spec = _dataclass_from(faults.FaultSpec, c.faults, "faults")
    faults.validate_fault_spec(fault_spec, m)

    ray_cfg = _dataclass_from(RayConfig, c.get("ray", ml_collections.ConfigDict()), "ray")
    ray_cfg.validate()
    if c.runtime == "ray" and learner_cfg.sync_every == 0:
        raise ValueError(
            "runtime='ray' runs learners against a syncer: set diloco.sync_every > 0 "
            "(data-parallel training without a syncer uses runtime='local')"
        )

    return RunConfig(
        model=model_cfg,
        data=data_cfg,
        train=train_cfg,
        mesh=mesh_cfg,
        learner=learner_cfg,
        syncer=syncer_cfg,
        faults=fault_spec,
        num_learners=m,
        devices_per_learner=per,
        runtime=c.runtime,
        name=c.name,
        ray=ray_cfg,
    )


def _vocab(data_cfg: DataConfig) -> int:
    from decoupled_diloco.data import vocab_size

    return vocab_size(data_cfg)
