"""The run configuration: an ml_collections default, validated once into dataclasses.

Every section's defaults are written once, in the frozen dataclass it validates into, with
each key's unit or allowed values commented there; `default_config()` builds the ConfigDict
from them. Config files under `configs/` start from `default_config()` and override what
they need; absl flags override any key (`--config.diloco.learners=8`). `validate()` turns
the ConfigDict into the dataclasses at the entry point, so bad configs fail at start-up
with the offending key in the message, and nothing deeper in the code reads a ConfigDict.
"""

import dataclasses
import importlib.util
import math
import os
import typing

import ml_collections
from absl import logging

from decoupled_diloco import faults, models, sharding
from decoupled_diloco.data import DataConfig, validate_data_config
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.jax_world import DistributedConfig
from decoupled_diloco.train.optimizer import TrainConfig

RUNTIMES = ("local", "ray")
RAY_ACCELERATORS = ("cpu", "tpu")
RAY_EVALUATE = ("driver", "learner", "off")  # where Θ is evaluated (runtime/ray/eval.py)


MAX_RAY_TEMP_DIR = 40  # characters (RayConfig.validate)


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """The `ray.*` section, read only by runtime = "ray" (runtime/ray/)."""

    address: str = ""  # "" = start a local cluster for the run; "auto" / "host:port" joins one
    max_restarts: int = 3  # Ray restarts of each learner and syncer process; -1 = unlimited
    # (a learner whose restarts are exhausted is lost: the run goes on without it)
    max_same_failures: int = 3  # a learner raising the same error (type + message, numbers
    # normalised) this many times in a row, without training past the step of the last one,
    # is stopped, not restarted (runtime/ray/failures.py); the run goes on without it. A
    # syncer shard raising the same error this many times in a row with no merge in between
    # fails the run. 0 = never
    accelerator: str = "cpu"  # "cpu" (fake CPU devices per process) | "tpu" (a slice each)
    num_cpus: int = 0  # CPUs a local cluster advertises; 0 = os.cpu_count()
    temp_dir: str = "/tmp/ray_dd"  # a local cluster's session files (Ray's socket paths are
    # limited to ~100 characters, so not under a deep workdir)
    checkpoint_dir: str = ""  # "" = <workdir>/checkpoints; multi-node: a path all nodes reach
    # (gs://BUCKET/run or a shared mount); required with accelerator "tpu"
    poll_seconds: float = 0.5  # how often the driver collects rows, records and progress
    evaluate: str = "driver"  # where Θ is evaluated: "driver" (its own devices) | "learner"
    # (the lowest live learner's devices, between its steps) | "off"

    def validate(self, runtime: str = "ray") -> None:
        """Every key's range; what a Ray run needs on top only when `runtime` is "ray"."""
        if self.accelerator not in RAY_ACCELERATORS:
            raise ValueError(
                f"ray.accelerator must be one of {RAY_ACCELERATORS}, got {self.accelerator!r}"
            )
        if self.max_restarts < -1:
            raise ValueError(f"ray.max_restarts must be >= -1, got {self.max_restarts}")
        if self.max_same_failures < 0:
            raise ValueError(
                f"ray.max_same_failures must be >= 0 (0 = never stop), got {self.max_same_failures}"
            )
        if self.num_cpus < 0:
            raise ValueError(f"ray.num_cpus must be >= 0, got {self.num_cpus}")
        if not self.poll_seconds > 0:
            raise ValueError(f"ray.poll_seconds must be > 0, got {self.poll_seconds}")
        if self.evaluate not in RAY_EVALUATE:
            raise ValueError(f"ray.evaluate must be one of {RAY_EVALUATE}, got {self.evaluate!r}")
        # A local cluster's sockets lie at <temp_dir>/session_<date>_<time>_<us>_<pid>/
        # sockets/plasma_store: ~66 characters past temp_dir, within AF_UNIX's 107.
        where = os.path.abspath(os.path.expanduser(self.temp_dir))
        if runtime == "ray" and not self.address and len(where) > MAX_RAY_TEMP_DIR:
            raise ValueError(
                f"ray.temp_dir={self.temp_dir!r} is {len(where)} characters long: a local Ray "
                f"cluster's socket paths below it would pass the 107 a Unix socket may have; "
                f"use one of at most {MAX_RAY_TEMP_DIR} (the default is /tmp/ray_dd)"
            )
        shared = "://" in self.checkpoint_dir or os.path.isabs(self.checkpoint_dir)
        if runtime == "ray" and self.accelerator == "tpu" and not shared:
            raise ValueError(
                "ray.accelerator='tpu' needs ray.checkpoint_dir: a path every node of the "
                "cluster reaches, e.g. gs://BUCKET/checkpoints/RUN (got "
                f"{self.checkpoint_dir!r}); checkpoints are written by the actors on their hosts"
            )


# Python's thread switch interval while a run's threads share one interpreter
# (runtime/gil.py): a thread waiting for the interpreter lock asks its holder to let go after
# this long. Python's own 5 ms made every numpy call of a merge wait that long for a busy
# learner thread; 0.2 ms merged 1.3-2x faster beside four of them (experiments/results/merge_gil/).
GIL_SWITCH_MS = 0.2

# Where the local runtime runs its syncer shards: "thread" beside the learners, or "process",
# one of its own each (runtime/syncer_process.py: what it costs and when it may pay).
LOCAL_SYNCERS = ("thread", "process")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, validated."""

    model: models.ModelConfig
    data: DataConfig
    train: TrainConfig
    mesh: sharding.MeshConfig
    diloco: DilocoConfig
    faults: faults.FaultSpec
    devices_per_learner: int
    runtime: str
    name: str
    ray: RayConfig = RayConfig()  # only read by runtime == "ray"
    distributed: DistributedConfig = DistributedConfig()  # one JAX world over several hosts
    gil_switch_ms: float = GIL_SWITCH_MS
    local_syncer: str = "thread"  # one of LOCAL_SYNCERS; read by runtime == "local" only

    @property
    def num_learners(self) -> int:
        return self.diloco.learners

    @property
    def uses_syncer(self) -> bool:
        return self.diloco.uses_syncer


def _placeholders(dc) -> ml_collections.ConfigDict:
    """One `None` placeholder per dataclass field ("take the preset's value"), typed for absl."""
    out = ml_collections.ConfigDict()
    hints = typing.get_type_hints(dc)
    for f in dataclasses.fields(dc):
        t = hints[f.name]
        t = tuple if typing.get_origin(t) is tuple else t
        out[f.name] = ml_collections.FieldReference(None, field_type=t)
    return out


def _section(dc, skip=()) -> ml_collections.ConfigDict:
    """A section holding a dataclass's defaults. A tuple default becomes a list held by a
    reference of any type, so that `--config.faults.crashes='[[0, 50]]'` is read as a Python
    literal (absl cannot override a list field; validation checks the shape)."""
    return ml_collections.ConfigDict(
        {
            f.name: _literal(list(f.default)) if isinstance(f.default, tuple) else f.default
            for f in dataclasses.fields(dc)
            if f.name not in skip
        }
    )


def _literal(value) -> ml_collections.FieldReference:
    return ml_collections.FieldReference(value, field_type=object)


def _run_seed_placeholder() -> ml_collections.FieldReference:
    """A section's `seed` placeholder: None = the run's top-level `seed` (an int sets it)."""
    return ml_collections.FieldReference(None, field_type=int)


def _seed_of(section: ml_collections.ConfigDict, run_seed: int) -> dict:
    """{"seed": run_seed} when the section leaves its seed to the run, else {}."""
    return {"seed": run_seed} if section.get("seed") is None else {}


def default_config() -> ml_collections.ConfigDict:
    """Defaults of every key. Each section's keys are documented, with units and allowed
    values, in the dataclass it validates into (named below)."""
    c = ml_collections.ConfigDict()
    c.name = "run"  # free-form run name, written to summary.json
    c.runtime = "local"  # "local" (threads in one process) | "ray" (one actor per learner)
    # Seeds the model init (train.seed, always), the order of training data (data.seed) and
    # the fault schedule (faults.seed) unless those are set; the order of eval windows is
    # fixed (data/pipeline.py EVAL_SEED) so runs with different seeds share their eval set.
    c.seed = 0
    c.devices_per_learner = 0  # devices in each learner's mesh; 0 = all devices / learners
    # Python's thread switch interval (sys.setswitchinterval) in ms while the run's threads
    # (learners, outboxes, stagers, syncer, merges) share one interpreter; 0 = Python's own
    # (5 ms). runtime/gil.py says why.
    c.gil_switch_ms = GIL_SWITCH_MS
    # runtime = "local": each syncer shard on a "thread" of the learners' process or in a
    # "process" of its own (no interpreter lock shared with the learners, but every offer and
    # merge copied across; runtime/syncer_process.py).
    c.local_syncer = "thread"
    # Model: a preset name plus optional per-field overrides; None = the preset's value
    # (decoupled_diloco/models/config.py ModelConfig).
    c.model = _placeholders(models.ModelConfig)
    c.model.preset = "tiny"  # a key of models.PRESETS: tiny, tiny_moe, gemma_2b, gemma_5b, ...
    c.data = _section(DataConfig)  # decoupled_diloco/data/config.py DataConfig
    c.data.seed = _run_seed_placeholder()  # None = the run's `seed`
    c.train = _section(TrainConfig, skip=("seed",))  # decoupled_diloco/train/optimizer.py
    c.mesh = _section(sharding.MeshConfig)  # each learner's own mesh (sharding.py MeshConfig)
    c.diloco = _section(DilocoConfig)  # decoupled_diloco/diloco/config.py DilocoConfig
    c.faults = _section(faults.FaultSpec)  # faults.py FaultSpec (seconds, or steps: faults.unit)
    c.faults.seed = _run_seed_placeholder()  # None = the run's `seed`
    c.ray = _section(RayConfig)  # RayConfig above (runtime = "ray" only)
    # A multi-host data-parallel run's JAX world (jax_world.py DistributedConfig).
    c.distributed = _section(DistributedConfig)
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
    if dc in (DilocoConfig, RayConfig, sharding.MeshConfig, DistributedConfig):
        # (other sections check their types themselves)
        _check_types(dc, values, prefix)
    values.update(extra)
    return dc(**values)


def _check_types(dc, values: dict, prefix: str) -> None:
    """Values of a config file (absl's flags are typed already) against the fields' types:
    None for a bool turned diloco.final_sync off (the unmerged tail dropped), None for a
    number failed deep in validation with a TypeError, True counted as 1 learner."""
    hints = typing.get_type_hints(dc)
    for k, v in values.items():
        want = hints.get(k)
        if want is bool:
            ok = isinstance(v, bool)
        elif want is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif want is float:
            ok = isinstance(v, int | float) and not isinstance(v, bool)
        elif want is str:
            ok = isinstance(v, str)
        else:
            continue
        if not ok:
            raise ValueError(f"{prefix}.{k} must be a {want.__name__}, got {v!r}")


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
    c.data.seq_len = 128  # (data.source left unset: stdlib, or data.path when one is given)
    c.train.steps = steps
    c.train.batch_size = batch_size  # per learner
    # Peak inner lr. These runs are short (a few hundred steps), so progress is limited by
    # step size: a sweep at 200 steps x 64 sequences (seed 0; experiments/README.md,
    # experiment 1) gave DP 2.04 / 1.88 / 1.79 / 1.74 and synchronous DiLoCo (M = 4)
    # 2.23 / 2.08 / 1.98 / 2.02 nats/byte at lr 0.003 / 0.006 / 0.012 / 0.024.
    c.train.learning_rate = 0.012
    # A tenth of the steps, and three evaluations: references, so that an override of
    # train.steps moves them too (a 4-step run warmed up over 30 steps, never at its peak).
    c.train.warmup_steps = (c.train.get_ref("steps") + 9) // 10
    c.train.eval_every = (c.train.get_ref("steps") + 2) // 3
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
    """Decoupled DiLoCo's knobs (the paper's K = 1, tau = 2, plus mixing alpha 0.5 and outer
    lr 0.75) on a multi-learner config.

    Grace may use the whole tau-step budget (gamma 1) and its cap must not bind: learners
    drift a step or more apart (seconds on a busy CPU); with a 1 s cap most merges held one
    learner at 100 steps (experiments/README.md, experiment 1).
    """
    c.diloco.overlap = 2  # tau (paper: 2)
    c.diloco.quorum = 1  # K (paper: 1)
    c.diloco.grace_gamma = 1.0
    c.diloco.max_grace = 4.0  # seconds
    c.diloco.max_wait = 0.0  # never wait for the syncer
    # Land on each merge of our offer and send the steps taken since it with the next offer
    # (diloco/learner.py): carried on top of the merge (the rebase) they cost the tiny CPU
    # model, 1000 steps, 2 seeds, 1.5% of synchronous streaming at its lr and 4.5% at three
    # times it, against 1.1% and 2.4% landing; on Shakespeare at its lr 0.5% and 0.6% (3
    # runs each; experiments/results/apply_land/). The gain grows with the inner step.
    c.diloco.apply = "land"
    c.diloco.weights = "tokens"
    c.diloco.merge = "rda"
    c.diloco.embedding_merge = "mean"
    # Learners take half of each merge's move (diloco/learner.py): a learner that never
    # waits applies merges steps late, and taking them whole makes the asynchrony's cost
    # grow with that delay. Tiny CPU model, outer (1.0, 0.0), 1000 steps: +0.4% with no
    # latency, -4.7% at 1 s links (10-step merge delay), -6.3% at 2 s (18 steps)
    # (experiments/results/merge_delay/).
    c.diloco.alpha = 0.5
    # A smaller outer step than synchronous DiLoCo's 1.0. With mixing, a step S below 1
    # moves Theta S / (1 + alpha (S - 1)) rounds of work per round (0.86 at S = 0.75; the
    # learner keeps half its distance and offers it again) while what the asynchrony adds
    # to a merge is scaled by S. Tiny CPU model, ratio to synchronous streaming (lr 1.0),
    # 2 seeds: 1000 steps 1.015x (1.026x at lr 1.0), Shakespeare 1.005x (1.016x), 300 steps
    # 1.031x (1.037-1.047x); synchronous arms lose 1.1% at 0.75 and keep 1.0
    # (experiments/README.md, section 0).
    c.diloco.outer_lr = 0.75
    # A learner's own checkpoints serve a resume of the whole run only (a crashed learner
    # rejoins from Θ): at most 10% of its time, however large the model (they are
    # synchronous; 100 steps of a `mid` learner on a GPU take about a second).
    c.train.checkpoint_duty = 0.1
    return c


def _check_train(t: TrainConfig) -> None:
    """Every `train.*` value in its range (ValueError naming the key): a value outside it
    would fail deep in a learner thread, or train quietly on something else."""

    def whole(x, low: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    def real(x) -> bool:  # (within float32: a larger value becomes inf on the device)
        number = isinstance(x, int | float) and not isinstance(x, bool)
        return number and math.isfinite(x) and abs(x) <= models.FLOAT32_MAX

    checks = [
        (whole(t.steps, 1), "steps", "an integer >= 1"),
        (whole(t.batch_size, 1), "batch_size", "an integer >= 1"),
        (whole(t.microbatches, 1), "microbatches", "an integer >= 1"),
        (real(t.learning_rate) and t.learning_rate > 0, "learning_rate", "> 0 and finite"),
        (whole(t.warmup_steps, 0), "warmup_steps", "an integer >= 0"),
        (whole(t.fresh_warmup_steps, -1), "fresh_warmup_steps",
         "an integer >= -1 (-1: warmup_steps, 0: none)"),
        (real(t.min_lr_ratio) and 0 <= t.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]"),
        (real(t.weight_decay) and t.weight_decay >= 0, "weight_decay", ">= 0"),
        (real(t.b1) and 0 <= t.b1 < 1, "b1", "in [0, 1)"),
        (real(t.b2) and 0 <= t.b2 < 1, "b2", "in [0, 1)"),
        (real(t.eps) and t.eps > 0, "eps", "> 0"),
        (real(t.grad_clip) and t.grad_clip >= 0, "grad_clip", ">= 0 (0 disables clipping)"),
        (whole(t.eval_every, 0), "eval_every", "an integer >= 0 (0 = only at the end)"),
        (whole(t.eval_batches, 1), "eval_batches", "an integer >= 1"),
        (whole(t.log_every, 1), "log_every", "an integer >= 1"),
        (whole(t.checkpoint_every, 0), "checkpoint_every", "an integer >= 0 (0 = at the end)"),
        (real(t.checkpoint_duty) and 0 < t.checkpoint_duty <= 1, "checkpoint_duty", "in (0, 1]"),
        (whole(t.prefetch, 0), "prefetch", "an integer >= 0 (batches ahead)"),
        (whole(t.metrics_lag, 1), "metrics_lag",
         "an integer >= 1 (steps dispatched before a step's metrics are read)"),
        (isinstance(t.tensorboard, bool), "tensorboard", "True or False"),
    ]  # fmt: skip
    for ok, key, want in checks:
        if not ok:
            value = getattr(t, key)
            big = isinstance(value, float) and math.isfinite(value) and not real(value)
            note = " (past float32's range, 3.4e38)" if big else ""
            raise ValueError(f"train.{key} must be {want}, got {value!r}{note}")


def data_config(c: ml_collections.ConfigDict) -> DataConfig:
    """The validated `data` section alone (tools that only read the corpus)."""
    data_cfg = _dataclass_from(DataConfig, c.data, "data", **_seed_of(c.data, c.seed))
    validate_data_config(data_cfg)
    return data_cfg


def _check_faults_fit_the_run(spec: faults.FaultSpec, d: DilocoConfig) -> None:
    """Faults that this kind of run cannot live through as configured."""
    if spec.membership and not d.uses_syncer:
        raise ValueError(
            "faults.membership (learners joining and leaving) needs a DiLoCo-family run with "
            "a syncer (diloco.sync_every > 0): a data-parallel run is one job, and one that "
            "leaves ends the run"
        )
    if spec.syncer_crashes and not d.uses_syncer:
        raise ValueError(
            "faults.syncer_crashes needs a DiLoCo-family run with a syncer (diloco.sync_every "
            "> 0): a data-parallel run has none to crash (they were ignored)"
        )
    links = [f for f in ("link_latency_s", "link_bandwidth_bps") if any(getattr(spec, f))]
    if links and not d.uses_syncer:
        raise ValueError(
            f"faults.{links[0]} needs a DiLoCo-family run with a syncer (diloco.sync_every "
            "> 0): a data-parallel run has no link to the syncer to delay (it was ignored)"
        )
    if d.uses_syncer and spec.syncer_crashes and spec.syncer_restart_delay_s >= d.join_timeout:
        raise ValueError(
            f"faults.syncer_restart_delay_s ({spec.syncer_restart_delay_s:g} s) must be below "
            f"diloco.join_timeout ({d.join_timeout:g} s): a learner that starts, restarts or "
            "joins during the outage waits at most join_timeout for the syncer, then fails "
            "the run; raise diloco.join_timeout"
        )


def validate(
    c: ml_collections.ConfigDict, require_packages: bool = True, checked: dict | None = None
) -> RunConfig:
    """Checks every section and returns the frozen RunConfig; ValueError names the key.
    `require_packages=False`: a package the runtime needs (Ray) may be missing here (the
    config is checked on one machine for a run on another). `checked`: what
    `check_before_world(c)` returned, when the caller ran it (its warnings said once)."""
    import jax

    checked = checked or check_before_world(c, require_packages)
    model_cfg, train_cfg, m = checked["model"], checked["train"], checked["diloco"].learners
    if c.runtime == "ray" and c.ray.get("accelerator") == "tpu" and c.devices_per_learner == 0:
        # (0 divides this process's devices, the driver's: a learner's are its slice's chips)
        raise ValueError(
            "devices_per_learner=0 with ray.accelerator='tpu': set it to the chips of one "
            "learner's slice (scripts/tpu/tpu_cluster.py passes them); this machine's "
            f"{jax.device_count()} devices are not a slice's"
        )
    per = _devices_per_learner(c.devices_per_learner, m, c.runtime, jax.device_count())
    mesh_cfg = _dataclass_from(sharding.MeshConfig, c.mesh, "mesh")
    shape = sharding.mesh_shape(mesh_cfg, per)
    experts = shape[sharding.MESH_AXES.index("expert")]
    if model_cfg.num_experts and experts > 1 and model_cfg.num_experts % experts:
        raise ValueError(
            f"mesh.expert ({experts}) must divide model.num_experts ({model_cfg.num_experts}): "
            "else every expert is copied whole onto each of the axis' devices"
        )
    batch_ways = math.prod(
        s for a, s in zip(sharding.MESH_AXES, shape, strict=True) if a != "tensor"
    )
    if train_cfg.batch_size % batch_ways:
        raise ValueError(
            f"train.batch_size ({train_cfg.batch_size}) must be divisible by the learner's "
            f"batch-parallel devices ({batch_ways} = mesh data*fsdp*expert)"
        )
    _check_microbatches(train_cfg, batch_ways)

    return RunConfig(
        **checked,
        mesh=mesh_cfg,
        devices_per_learner=per,
        runtime=c.runtime,
        name=c.name,
    )


def check_before_world(c: ml_collections.ConfigDict, require_packages: bool = True) -> dict:
    """The checks of `validate` that need no devices, and so start no JAX backend: the
    entry point runs them before it joins a multi-host world (`distributed.*`), which waits
    for every host up to distributed.initialization_timeout, then aborts the process; a bad
    config was named only after that. Returns the sections checked (RunConfig's fields)."""
    if c.runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {c.runtime!r}")
    if not isinstance(c.seed, int) or isinstance(c.seed, bool) or not 0 <= c.seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {c.seed!r}")  # (seeds.key)
    gil_ms = c.get("gil_switch_ms", GIL_SWITCH_MS)
    # Python keeps whole microseconds of it: a positive value below 1 µs would become 0.
    number = isinstance(gil_ms, (int, float)) and not isinstance(gil_ms, bool)
    if not number or not (gil_ms == 0 or 0.001 <= gil_ms <= 100):
        raise ValueError(
            f"gil_switch_ms must be 0 (Python's) or in [0.001, 100] ms, got {gil_ms!r}"
        )
    local_syncer = c.get("local_syncer", "thread")
    if local_syncer not in LOCAL_SYNCERS:
        raise ValueError(f"local_syncer must be one of {LOCAL_SYNCERS}, got {local_syncer!r}")

    model_over = {k: v for k, v in c.model.items() if k != "preset" and v is not None}
    if isinstance(model_over.get("attention_pattern"), list):
        model_over["attention_pattern"] = tuple(model_over["attention_pattern"])
    model_cfg = models.get_model_config(c.model.preset, **model_over)
    models.validate_model_config(model_cfg)

    data_cfg = data_config(c)
    if model_cfg.vocab_size < _vocab(data_cfg):
        raise ValueError(
            f"model.vocab_size ({model_cfg.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({_vocab(data_cfg)}): set --config.model.vocab_size={_vocab(data_cfg)}"
            " (or more)"
        )

    train_cfg = _dataclass_from(TrainConfig, c.train, "train", seed=c.seed)
    _check_train(train_cfg)
    if train_cfg.warmup_steps > train_cfg.steps:
        logging.warning(
            "train.warmup_steps (%d) is past train.steps (%d): the learning rate never reaches "
            "its peak (it ends at %.0f%% of train.lr) and never decays",
            train_cfg.warmup_steps, train_cfg.steps,
            100 * train_cfg.steps / train_cfg.warmup_steps,
        )  # fmt: skip

    diloco_cfg = _dataclass_from(DilocoConfig, c.diloco, "diloco")
    diloco_cfg.validate()
    _check_fragments_fit_the_period(diloco_cfg)
    _check_an_offer_is_made(diloco_cfg, train_cfg.steps)
    _warn_of_syncer_keys_without_one(diloco_cfg, local_syncer)
    m = diloco_cfg.learners

    fault_spec = _dataclass_from(faults.FaultSpec, c.faults, "faults", **_seed_of(c.faults, c.seed))
    faults.validate_fault_spec(fault_spec, m, max_step=train_cfg.steps)

    ray_cfg = _dataclass_from(RayConfig, c.get("ray", ml_collections.ConfigDict()), "ray")
    ray_cfg.validate(c.runtime)  # (a TPU config run as runtime "local" needs no Ray paths)
    if require_packages and c.runtime == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError('runtime="ray" needs Ray: pip install -e ".[ray]"')
    if c.runtime == "ray" and not diloco_cfg.uses_syncer:
        raise ValueError(
            "runtime='ray' runs learners against a syncer: set diloco.sync_every > 0 "
            "(data-parallel training without a syncer uses runtime='local')"
        )
    _check_faults_fit_the_run(fault_spec, diloco_cfg)
    _warn_of_unread_keys(c.runtime, model_over, model_cfg, fault_spec, ray_cfg, local_syncer)
    crashes = len(fault_spec.syncer_crashes)
    if c.runtime == "ray" and 0 <= ray_cfg.max_restarts < crashes:
        # Each scheduled syncer crash kills every shard's process (runtime/ray/runtime.py),
        # using one of its restarts; a shard out of restarts fails the run.
        raise ValueError(
            f"faults.syncer_crashes schedules {crashes} syncer crash(es), but "
            f"ray.max_restarts={ray_cfg.max_restarts} lets a syncer shard's process restart "
            f"only that often: crash {ray_cfg.max_restarts + 1} would end the run; raise "
            "ray.max_restarts (-1 = unlimited)"
        )
    if c.runtime == "ray" and fault_spec.unit == "steps" and fault_spec.membership:
        raise ValueError(
            'faults.membership with faults.unit="steps" needs the local runtime: a Ray '
            "learner cannot see the run's lead step (give its membership in seconds)"
        )

    dist_cfg = distributed_config(c)
    if dist_cfg.enabled and (c.runtime != "local" or diloco_cfg.uses_syncer):
        raise ValueError(
            "distributed.num_processes > 1 (one JAX world over several hosts) is for the "
            "data-parallel baseline: runtime='local' and diloco.sync_every=0 (one learner). "
            "Decoupled DiLoCo over several hosts uses runtime='ray' (each learner is a world "
            "of its own slice's hosts)"
        )

    return dict(
        model=model_cfg,
        data=data_cfg,
        train=train_cfg,
        diloco=diloco_cfg,
        faults=fault_spec,
        ray=ray_cfg,
        distributed=dist_cfg,
        gil_switch_ms=float(gil_ms),
        local_syncer=local_syncer,
    )


def _check_microbatches(t: TrainConfig, batch_ways: int) -> None:
    """Every microbatch must split evenly over the batch-parallel devices, as a batch does."""
    n = t.microbatches  # (an int >= 1: _check_train)
    if t.batch_size % n or (t.batch_size // n) % batch_ways:
        raise ValueError(
            f"train.batch_size ({t.batch_size}) must be divisible by train.microbatches ({n}) "
            f"times the learner's batch-parallel devices ({batch_ways} = mesh "
            "data*fsdp*expert): each microbatch is split over those devices"
        )


def distributed_config(c: ml_collections.ConfigDict) -> DistributedConfig:
    """The validated `distributed.*` section alone: the entry point joins the JAX world it
    names before anything starts JAX's backend (which `validate` does)."""
    section = c.get("distributed", ml_collections.ConfigDict())
    dist = _dataclass_from(DistributedConfig, section, "distributed")
    dist.validate()
    return dist


def _check_fragments_fit_the_period(d: DilocoConfig) -> None:
    """H >= P: fragment p is due at offset p*H/P of every H-step period, so with H < P
    several fragments share an offset and are synced on the same step, which defeats the
    staggering fragments exist for (and P > H is never the paper's setting, P = H = 24)."""
    if d.uses_syncer and d.sync_every < d.fragments:
        raise ValueError(
            f"diloco.fragments ({d.fragments}) must be <= diloco.sync_every ({d.sync_every}): "
            "fragments are synced at staggered offsets p*H/P of each H-step period, and with "
            "fewer steps than fragments several would be due on the same step"
        )


def _warn_of_syncer_keys_without_one(d: DilocoConfig, local_syncer: str) -> None:
    """A data-parallel run (diloco.sync_every = 0) reads no other diloco.* key: one set off
    its default is ignored, and said so (a run that forgot sync_every trained plain
    data-parallel without a word). A warning, not an error: a data-parallel arm derived
    from a DiLoCo config (experiments/, scripts/tpu) carries that config's keys."""
    if d.uses_syncer:
        return
    default = DilocoConfig()
    ignored = [f"diloco.{f.name}" for f in dataclasses.fields(DilocoConfig)
               if f.name not in ("learners", "sync_every")
               and getattr(d, f.name) != getattr(default, f.name)]  # fmt: skip
    if local_syncer != LOCAL_SYNCERS[0]:
        ignored.append("local_syncer")
    if ignored:
        logging.warning(
            "diloco.sync_every=0 (data-parallel: no syncer, no outer step): %s %s ignored; "
            "set diloco.sync_every (H) for a DiLoCo-family run", ", ".join(ignored),
            "is" if len(ignored) == 1 else "are",
        )  # fmt: skip


def _warn_of_unread_keys(
    runtime: str, model_over: dict, model_cfg, fault_spec, ray_cfg: RayConfig, local_syncer: str
) -> None:
    """Keys set that this run never reads, said once each: a fault knob whose fault is off,
    a sliding window with no local layer, the ray.* section of a local run and local_syncer
    of a Ray run. Warnings, not errors: an arm derived from another config (experiments/,
    scripts/tpu) carries that config's keys."""
    unread = [(f"faults.{f}", why) for f, why in faults.unread_fields(fault_spec)]
    if "sliding_window" in model_over and not any(
        model_cfg.attention_kind(i) == "local" for i in range(model_cfg.num_layers)
    ):
        unread.append(("model.sliding_window", "no layer of model.attention_pattern is local"))
    if runtime != "ray":
        default = RayConfig()
        unread += [(f"ray.{f.name}", f"only read with runtime='ray' (this is {runtime!r})")
                   for f in dataclasses.fields(RayConfig)
                   if getattr(ray_cfg, f.name) != getattr(default, f.name)]  # fmt: skip
    elif local_syncer != LOCAL_SYNCERS[0]:
        unread.append(("local_syncer", "only read with runtime='local' (a Ray syncer is an actor)"))
    for key, why in unread:
        logging.warning("%s is ignored: %s", key, why)


def _check_an_offer_is_made(d: DilocoConfig, steps: int) -> None:
    """Without the final sync, a learner offers only at its fragments' due steps: the first
    at H/P (rounded down; H with one fragment). A run shorter than that merges nothing, and
    would fail after training with the initial model as its result."""
    if not d.uses_syncer or d.final_sync:
        return
    first = min((p * d.sync_every) // d.fragments or d.sync_every for p in range(d.fragments))
    if steps < first:
        raise ValueError(
            f"train.steps ({steps}) ends before the first offer (step {first}: fragments are due "
            f"at offsets p*H/P of each H = {d.sync_every} steps, and diloco.final_sync is off): "
            "nothing would be merged; train longer or turn diloco.final_sync on"
        )


def _devices_per_learner(asked: int, m: int, runtime: str, n_dev: int) -> int:
    """Devices in each learner's mesh. Local learners take disjoint groups of this many of
    the process's devices (round-robin when there are more learners than groups), so the
    group size must divide the device count: else the remainder would sit idle. Ray learners
    own devices in their own processes (a TPU slice each), not the driver's."""
    whole = isinstance(asked, int) and not isinstance(asked, bool)  # (None, True: a file's)
    if not whole or asked < 0 or (runtime == "local" and asked > n_dev):
        raise ValueError(
            f"devices_per_learner must be in [0, {n_dev}] (0 = all devices / learners), got {asked}"
        )
    if runtime == "local" and asked and n_dev % asked:
        raise ValueError(
            f"devices_per_learner ({asked}) must divide the {n_dev} devices: learners take "
            f"disjoint groups of {asked}, and the {n_dev % asked} left over would sit idle"
        )
    if asked:
        return asked
    if n_dev // m < 1:
        raise ValueError(
            f"diloco.learners ({m}) exceeds the {n_dev} available devices; set "
            "devices_per_learner (learners then share devices round-robin)"
        )
    # The largest group size <= n_dev / m that tiles the devices.
    return max(d for d in range(1, n_dev // m + 1) if n_dev % d == 0)


def _vocab(data_cfg: DataConfig) -> int:
    from decoupled_diloco.data import vocab_size

    return vocab_size(data_cfg)
