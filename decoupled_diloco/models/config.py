"""Model configuration: the `ModelConfig` dataclass, named presets (plain data) and validation.

Every model variant is a config field; presets only override fields. Nothing in the model code
branches on a preset's name.
"""

import dataclasses
import math
import numbers

ATTENTION_KINDS = ("global", "local")
MOE_LAYER_CHOICES = ("none", "all", "every_other")
DTYPES = ("float32", "bfloat16")
# Config floats a device computes with must be finite in float32 (a larger one becomes inf,
# silently: an eps of 1e300 trained nothing).
FLOAT32_MAX = 3.4028234663852886e38
# Sizes past these are no model a host builds: sizes index with int32, and tracing a model
# of more layers than this took minutes before any error.
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 1024
MAX_HEAD_DIM = 2**16
MOE_GATES = ("chosen_softmax", "full_softmax")
# The mixture-of-experts keys, which only an MoE model (moe_layers != "none") reads.
MOE_KEYS = ("num_experts", "experts_per_token", "expert_hidden", "capacity_factor",
            "shared_expert", "moe_gate", "load_balance_weight", "router_z_weight")  # fmt: skip
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLS = ("xla", "dot_product_attention")
LOGITS_GATHERS = ("per_chunk", "once")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Gemma-style decoder (dense or MoE). Frozen, hence hashable: usable as a jit static arg."""

    vocab_size: int = 256  # tokens in the vocabulary (embedding rows); 256 = byte-level
    d_model: int = 64  # residual stream width, features
    num_layers: int = 2  # decoder blocks (unscanned: one param subtree each)
    num_heads: int = 4  # query heads per attention layer
    num_kv_heads: int = 4  # == num_heads: MHA; 1: MQA; else GQA (num_heads % num_kv_heads == 0)
    head_dim: int = 16  # features per head; must be even (rotary rotates half-split pairs)
    ffw_hidden: int = 256  # GeGLU hidden width of dense layers, features
    qk_norm: bool = False  # True: RMSNorm on each query / key head before rotary
    attn_logit_softcap: float = 0.0  # cap * tanh(logits / cap) on attention logits; 0 disables
    final_logit_softcap: float = 0.0  # same on the output logits; 0 disables
    attention_pattern: tuple[str, ...] = ("global",)  # cycled over layers; "global" | "local"
    sliding_window: int = 0  # tokens a "local" layer sees (incl. itself); > 0 if any is local
    rope_base: float = 10_000.0  # rotary base wavelength (pair i turns at base**(-2i/head_dim))
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"; params are always float32
    # Memory and speed only (the math is the same to float tolerance), see transformer.py:
    # "none" keeps every activation for the backward pass | "full" recomputes each block's
    # forward in the backward pass (keeps only block inputs) | "dots" keeps the weight
    # matmuls' outputs and recomputes the rest (attention scores, softmax, norms, gelu).
    remat: str = "none"
    # "xla": the reference einsum attention (layers.py) | "dot_product_attention":
    # jax.nn.dot_product_attention, cuDNN's fused kernel on GPU with bfloat16 (layers.py);
    # it has no logit softcap, so it needs attn_logit_softcap = 0.
    attention_impl: str = "xla"
    # Training's output layer and loss, `logits_chunk` sequence positions at a time (all the
    # batch's rows), each chunk's logits recomputed in the backward pass instead of kept:
    # the float32 logits then take rows x logits_chunk x vocab_size x 4 bytes per buffer,
    # not rows x seq_len x vocab_size x 4 (gemma_2b at 16 x 1024 tokens: 17 GB each, several
    # live at once). 0: the whole sequence at once. Same loss and gradients to float tolerance.
    logits_chunk: int = 0
    # How the chunks reach an embedding split over the batch axes (FSDP): "per_chunk" leaves
    # it to XLA, which all-gathers it and reduce-scatters its gradient for every chunk |
    # "once": one all-gather and one gradient reduction per step, for ~3 x vocab x d_model x
    # 4 bytes more per device (train/step.py `_chunks_on_mesh`; scripts/tpu/README.md).
    logits_gather: str = "per_chunk"
    # Mixture of experts.
    moe_layers: str = "none"  # "none" | "all" | "every_other" (odd layers 1, 3, 5, ...)
    num_experts: int = 0  # routed experts per MoE layer (E); >= 1 when moe_layers != "none"
    experts_per_token: int = 2  # top-k, in [1, num_experts]
    expert_hidden: int = 0  # GeGLU hidden width per expert (and of the shared expert), features
    capacity_factor: float = 1.25  # per-expert buffer = ceil(cf * tokens * k / E); <= 0: dropless
    shared_expert: bool = False  # True: always-on dense GeGLU added to the routed output
    # "chosen_softmax": gates = softmax over the k chosen logits (needs k >= 2: with k = 1 the
    # gate is always 1 and the LM loss cannot train the router) | "full_softmax" (Switch):
    # gate = full-softmax probability of each chosen expert, not renormalised.
    moe_gate: str = "chosen_softmax"
    load_balance_weight: float = 0.01  # weight of the Switch load-balancing loss (1 = uniform)
    router_z_weight: float = 0.001  # weight of the router z-loss (mean logsumexp(logits)^2)

    def attention_kind(self, layer: int) -> str:
        """ "global" or "local" for block `layer` (the pattern repeats over layers)."""
        return self.attention_pattern[layer % len(self.attention_pattern)]

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers == "all" or (self.moe_layers == "every_other" and layer % 2 == 1)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))


# Gemma 2 shapes are from the Gemma 2 report (arXiv 2408.00118, table 1) and the released
# configs: pre+post RMSNorm, GeGLU, alternating local (window 4096) / global attention starting
# with local, attention softcap 50, final softcap 30, vocab 256128, query scale head_dim**-0.5
# (query_pre_attn_scalar = 256 = head_dim for 2B and 9B). Counts include the tied embedding.
_GEMMA2 = dict(
    vocab_size=256_128,
    head_dim=256,
    attention_pattern=("local", "global"),
    sliding_window=4096,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    # 256k vocabulary: the float32 logits of 16 x 1024 tokens are 17 GB per buffer; in chunks
    # of 256 positions a quarter of that, for one more forward pass of the output layer
    # (2 x 0.59e9 FLOPs per token, ~7% of a gemma_2b step's).
    logits_chunk=256,
)

PRESETS: dict[str, dict] = {
    # ~140k params, byte-level: a miniature of gemma_2b (GQA, local/global, softcaps) for CPU
    # tests. 256*64 embedding + 2 * (12_288 attn + 49_152 ffw + 256 norms) + 64 = 139_840.
    "tiny": dict(
        num_kv_heads=2,
        attention_pattern=("local", "global"),
        sliding_window=64,
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
    ),
    # Same backbone as tiny with every FFW an MoE of 4 experts, top-2, hidden 128: activated
    # 2 * 3 * 64 * 128 = 49_152 expert params per layer, as tiny's dense FFW, so activated
    # ~140k (+256 router per layer); total ~238k.
    "tiny_moe": dict(
        num_kv_heads=2,
        attention_pattern=("local", "global"),
        sliding_window=64,
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
        moe_layers="all",
        num_experts=4,
        experts_per_token=2,
        expert_hidden=128,
    ),
    # ~31M params, byte-level, for quality comparisons at a scale above tiny (a GPU runs
    # 1000 steps of 4 learners x 32 x 256 tokens in minutes): d 512, 8 layers, 8 heads /
    # 4 kv heads of 64, GeGLU ffw 2048; tiny's local window (64), pattern and softcaps.
    # 256*512 embedding + 8 * (786_432 attn + 3_145_728 ffw + 2_048 norms) + 512 = 31.6M.
    "mid": dict(
        d_model=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        ffw_hidden=2048,
        attention_pattern=("local", "global"),
        sliding_window=64,
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
    ),
    # Gemma 2 2B: d 2304, 26 layers, 8 heads / 4 kv heads, ffw 9216 -> 2.61e9 params
    # (0.59e9 embedding + 26 * 77.9e6).
    "gemma_2b": dict(
        _GEMMA2, d_model=2304, num_layers=26, num_heads=8, num_kv_heads=4, ffw_hidden=9216
    ),
    # There is no Gemma 2 5B; this interpolates between 2B and 9B with Gemma 7B's width:
    # d 3072, 16 heads / 8 kv heads, ffw 4 * d = 12288, 28 layers -> 5.01e9 params
    # (0.79e9 embedding + 28 * 151e6).
    "gemma_5b": dict(
        _GEMMA2, d_model=3072, num_layers=28, num_heads=16, num_kv_heads=8, ffw_hidden=12_288
    ),
    # Gemma 2 9B: d 3584, 42 layers, 16 heads / 8 kv heads, ffw 14336 -> 9.24e9 params
    # (0.92e9 embedding + 42 * 198e6).
    "gemma_9b": dict(
        _GEMMA2, d_model=3584, num_layers=42, num_heads=16, num_kv_heads=8, ffw_hidden=14_336
    ),
    # gemma_2b backbone, every FFW an MoE of 16 experts, top-2. Activated per layer:
    # attn 14.16e6 + router 2304 * 16 + 2 experts * 3 * 2304 * 5120 (70.78e6) = 84.98e6;
    # 26 layers + 0.59e9 embedding -> 2.80e9 activated (15.7e9 total).
    "moe_2p8b_active": dict(
        _GEMMA2,
        d_model=2304,
        num_layers=26,
        num_heads=8,
        num_kv_heads=4,
        moe_layers="all",
        num_experts=16,
        experts_per_token=2,
        expert_hidden=5120,
    ),
    # gemma_5b backbone, every FFW an MoE of 16 experts, top-2. Activated per layer:
    # attn 37.75e6 + router 3072 * 16 + 2 * 3 * 3072 * 3840 (70.78e6) = 108.6e6;
    # 28 layers + 0.79e9 embedding -> 3.83e9 activated (17.7e9 total).
    "moe_3p8b_active": dict(
        _GEMMA2,
        d_model=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        moe_layers="all",
        num_experts=16,
        experts_per_token=2,
        expert_hidden=3840,
    ),
}


def get_model_config(preset: str, **overrides) -> ModelConfig:
    """The preset's config with `overrides` (field=value) applied, validated. Mixture-of-
    experts keys among `overrides` need an MoE model: on a dense one nothing would read them."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown model config key(s) {unknown}; known keys: {sorted(fields)}")
    values = {**PRESETS[preset], **overrides}
    if not isinstance(values.get("attention_pattern", ()), tuple):  # lists arrive from flags
        values["attention_pattern"] = tuple(values["attention_pattern"])
    cfg = ModelConfig(**values)
    validate_model_config(cfg)
    ignored = [k for k in MOE_KEYS if k in overrides]
    if cfg.moe_layers == "none" and ignored:
        whose = "" if "moe_layers" in overrides else f", as preset {preset!r} has it"
        raise ValueError(
            f"model.{ignored[0]} is set, but the model is dense (model.moe_layers='none'"
            f"{whose}), so nothing reads it: set model.moe_layers to 'all' or 'every_other' "
            f"for mixture-of-experts layers, or drop model.{ignored[0]}"
        )
    if "ffw_hidden" in overrides and cfg.num_moe_layers == cfg.num_layers:
        raise ValueError(
            f"model.ffw_hidden is set, but every layer of the model is mixture-of-experts "
            f"(model.moe_layers={cfg.moe_layers!r}), so nothing reads it: the experts' width "
            "is model.expert_hidden"
        )
    return cfg


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def validate_model_config(cfg: ModelConfig) -> None:
    """Raises ValueError naming the offending field ("model.<field>") if `cfg` is unusable."""
    kinds = {int: ("an int", numbers.Integral), float: ("a number", numbers.Real),
             bool: ("a bool (True or False)", bool), str: ("a string", str)}  # fmt: skip
    for f in dataclasses.fields(cfg):  # (a float width ended in a shape error deep in flax)
        if f.type in kinds:
            value, (what, accepted) = getattr(cfg, f.name), kinds[f.type]
            bad_bool = isinstance(value, bool) and f.type is not bool
            _require(isinstance(value, accepted) and not bad_bool,
                     f"model.{f.name} ({value!r}) must be {what}")  # fmt: skip
    for f in dataclasses.fields(cfg):  # inf / nan pass every range check below, then misbehave
        value = getattr(cfg, f.name)
        if isinstance(value, float):
            _require(math.isfinite(value), f"model.{f.name} ({value}) must be finite")
            in_range = abs(value) <= FLOAT32_MAX
            _require(in_range, f"model.{f.name} ({value}) must be within float32's (3.4e38)")
        elif isinstance(value, int) and not isinstance(value, bool):
            _require(value <= MAX_SIZE, f"model.{f.name} ({value}) must be < 2**31")
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        value = getattr(cfg, name)
        _require(value > 0, f"model.{name} ({value}) must be > 0")
    _require(cfg.num_layers <= MAX_LAYERS,
             f"model.num_layers ({cfg.num_layers}) must be at most {MAX_LAYERS}")  # fmt: skip
    _require(cfg.head_dim <= MAX_HEAD_DIM,
             f"model.head_dim ({cfg.head_dim}) must be at most {MAX_HEAD_DIM}")  # fmt: skip
    _require(
        cfg.num_heads % cfg.num_kv_heads == 0,
        f"model.num_heads ({cfg.num_heads}) must be divisible by "
        f"model.num_kv_heads ({cfg.num_kv_heads})",
    )
    _require(cfg.head_dim % 2 == 0, f"model.head_dim ({cfg.head_dim}) must be even for rotary")
    for name in ("attn_logit_softcap", "final_logit_softcap"):
        value = getattr(cfg, name)
        _require(value >= 0, f"model.{name} ({value}) must be >= 0 (0 disables)")
    _require(cfg.rope_base > 0, f"model.rope_base ({cfg.rope_base}) must be > 0")
    _require(cfg.dtype in DTYPES, f"model.dtype ({cfg.dtype!r}) must be one of {DTYPES}")
    _require(
        cfg.remat in REMAT_POLICIES,
        f"model.remat ({cfg.remat!r}) must be one of {REMAT_POLICIES}",
    )
    _require(
        isinstance(cfg.logits_chunk, int)
        and not isinstance(cfg.logits_chunk, bool)
        and cfg.logits_chunk >= 0,
        f"model.logits_chunk ({cfg.logits_chunk!r}) must be an int >= 0 (0: the whole "
        f"sequence at once)",
    )
    _require(
        cfg.logits_gather in LOGITS_GATHERS,
        f"model.logits_gather ({cfg.logits_gather!r}) must be one of {LOGITS_GATHERS}",
    )
    _require(
        cfg.logits_gather == "per_chunk" or cfg.logits_chunk > 0,
        f"model.logits_gather = {cfg.logits_gather!r} applies to the chunks of the output "
        f"layer, but model.logits_chunk is 0 (the whole sequence at once, one gather "
        f"already): set model.logits_chunk > 0 or drop model.logits_gather",
    )
    _require(
        cfg.attention_impl in ATTENTION_IMPLS,
        f"model.attention_impl ({cfg.attention_impl!r}) must be one of {ATTENTION_IMPLS}",
    )
    _require(
        cfg.attention_impl == "xla" or cfg.attn_logit_softcap == 0,
        f"model.attention_impl = {cfg.attention_impl!r} has no attention logit softcap "
        f"(jax.nn.dot_product_attention applies none): set model.attn_logit_softcap = 0 "
        f"(now {cfg.attn_logit_softcap}; Gemma 3 drops it for model.qk_norm = True) or use "
        f"model.attention_impl = 'xla'",
    )

    pattern = cfg.attention_pattern
    _require(
        isinstance(pattern, tuple) and len(pattern) > 0,
        f"model.attention_pattern ({pattern!r}) must be a non-empty tuple",
    )
    for kind in pattern:
        _require(
            kind in ATTENTION_KINDS,
            f"model.attention_pattern entry {kind!r} must be one of {ATTENTION_KINDS}",
        )
    uses_local = any(cfg.attention_kind(i) == "local" for i in range(cfg.num_layers))
    _require(
        cfg.sliding_window > 0 or not uses_local,
        f"model.sliding_window ({cfg.sliding_window}) must be > 0 when "
        f"model.attention_pattern has 'local' layers",
    )

    _require(
        cfg.moe_layers in MOE_LAYER_CHOICES,
        f"model.moe_layers ({cfg.moe_layers!r}) must be one of {MOE_LAYER_CHOICES}",
    )
    if cfg.num_moe_layers < cfg.num_layers:
        _require(cfg.ffw_hidden > 0, f"model.ffw_hidden ({cfg.ffw_hidden}) must be > 0")
    if cfg.moe_layers == "none":
        return
    _require(
        cfg.num_moe_layers > 0,
        f"model.moe_layers ({cfg.moe_layers!r}) selects no layer with "
        f"model.num_layers ({cfg.num_layers})",
    )
    _require(
        cfg.num_experts >= 1,
        f"model.num_experts ({cfg.num_experts}) must be >= 1 when "
        f"model.moe_layers is {cfg.moe_layers!r}",
    )
    _require(
        1 <= cfg.experts_per_token <= cfg.num_experts,
        f"model.experts_per_token ({cfg.experts_per_token}) must be in "
        f"[1, model.num_experts ({cfg.num_experts})]",
    )
    _require(
        cfg.expert_hidden > 0,
        f"model.expert_hidden ({cfg.expert_hidden}) must be > 0 in an MoE model (each "
        "expert's GeGLU width: set it, or start from an MoE preset such as tiny_moe)",
    )
    _require(
        cfg.moe_gate in MOE_GATES,
        f"model.moe_gate ({cfg.moe_gate!r}) must be one of {MOE_GATES}",
    )
    _require(
        not (cfg.experts_per_token == 1 and cfg.moe_gate == "chosen_softmax"),
        "model.experts_per_token = 1 with model.moe_gate = 'chosen_softmax' gives every token "
        "a gate of exactly 1, so the language-model loss never reaches the router; use "
        "model.moe_gate = 'full_softmax' (Switch) or model.experts_per_token >= 2",
    )
    for name in ("load_balance_weight", "router_z_weight"):
        value = getattr(cfg, name)
        _require(value >= 0, f"model.{name} ({value}) must be >= 0")
