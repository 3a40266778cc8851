"""Gemma-style decoder and the functional boundary of the model package.

Outside `models/` the model is four pure functions over a plain nested dict of float32 arrays:
`init_params`, `forward`, `param_logical_axes`, `count_params`. The dict layout is a contract
(fragments, checkpoints and sharding rules key on its `/`-joined leaf names), one key per block,
never scanned:

  embedder/embedding [V, D]                      (tied: also the output projection)
  block_<i>/pre_attn_norm/scale [D]
  block_<i>/attn/{q [D, H, G], k [D, K, G], v [D, K, G], out [H, G, D]}
  block_<i>/attn/{q_norm, k_norm}/scale [G]      (only if qk_norm)
  block_<i>/post_attn_norm/scale, pre_ffw_norm/scale, post_ffw_norm/scale [D]
  block_<i>/ffw/{gate [D, F], up [D, F], down [F, D]}              (dense layers)
  block_<i>/moe/{router [D, E], gate [E, D, F], up [E, D, F], down [E, F, D]}   (MoE layers)
  block_<i>/moe/shared/{gate, up, down}          (only if shared_expert)
  final_norm/scale [D]

Rematerialisation (`cfg.remat`, training only: decoding with a KV cache never remats) wraps
each decoder block in `jax.checkpoint` (flax `nn.remat`; param names are unchanged):
"full" saves nothing inside a block, so the backward pass reruns the block's forward from its
input (activation memory ~ one [B, T, D] per block, ~1/3 more FLOPs); "dots" saves the
outputs of the weight projections: `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`
(matmuls with no dot batch dimension: q/k/v/out, ffw, router) and the routed experts' matmuls
by name (`moe.EXPERT_MATMUL`: batched over E in the capacity path, grouped in the dropless
one, so that policy alone would recompute them), while attention's [B, H, T, S] scores and
probabilities (batched dots over B and H), softmax, norms, rotary and gelu are recomputed; it
removes the T^2 memory for little recompute.

Embedding init: normal with std 0.02 (GPT-2 convention). Inputs are embedding * sqrt(D), and
logits are final-normed x (RMS 1) @ embedding.T, so initial logits have std 0.02 * sqrt(D): ~0.16
for D = 64, giving an initial loss close to ln(V); Gemma's own default (std 0.01) is similar.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco.models.config import ModelConfig, validate_model_config
from decoupled_diloco.models.layers import Attention, FeedForward, RMSNorm, param, softcap
from decoupled_diloco.models.moe import EXPERT_MATMUL, MoE
from decoupled_diloco.sharding import constrain

EMBEDDING_INIT_STD = 0.02
# The residual stream's sharding: rows over the batch axes, d_model whole on every device.
RESIDUAL = ("batch", None, None)


class Embedder(nn.Module):
    """Tied token embedding: `encode` tokens to scaled vectors, `decode` vectors to logits."""

    cfg: ModelConfig

    def setup(self):
        shape = (self.cfg.vocab_size, self.cfg.d_model)
        init = nn.initializers.normal(EMBEDDING_INIT_STD)
        self.embedding = param(self, "embedding", ("vocab", "embed"), shape, init)

    def encode(self, tokens_BT: jax.Array) -> jax.Array:
        dtype = jnp.dtype(self.cfg.dtype)
        x_BTD = jnp.take(self.embedding, tokens_BT, axis=0).astype(dtype)
        return constrain(x_BTD * jnp.asarray(math.sqrt(self.cfg.d_model), dtype), RESIDUAL)

    def decode(self, x_BTD: jax.Array) -> jax.Array:
        return output_logits(self.cfg, self.embedding, x_BTD)


def output_logits(cfg: ModelConfig, embedding_VD: jax.Array, x_BTD: jax.Array) -> jax.Array:
    """The tied output layer: final-normed x_BTD @ embedding.T in float32, softcapped. Also
    applied a chunk of positions at a time by the training loss (`model.logits_chunk`)."""
    embedding = embedding_VD.astype(x_BTD.dtype)
    logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD, embedding, preferred_element_type=jnp.float32)
    return softcap(constrain(logits_BTV, ("batch", None, "vocab")), cfg.final_logit_softcap)


class Block(nn.Module):
    """Gemma 2 block: x + post_norm(attn(pre_norm(x))), then the same around the (MoE) FFW."""

    cfg: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x_BTD: jax.Array, cache: dict | None = None, index=0, group: int = 0):
        """(x_BTD, MoE stats or None), plus the layer's updated cache if given one (its
        keys and values, and a capacity MoE layer's claimed expert slots, "claimed" [B, E],
        in buffers sized for `group` tokens, 0: the cache's length; decode.py)."""
        cfg = self.cfg
        window = cfg.sliding_window if cfg.attention_kind(self.layer) == "local" else 0
        attn = Attention(cfg, window, name="attn")
        kv = None if cache is None else {"k": cache["k"], "v": cache["v"]}
        h_BTD = attn(RMSNorm(name="pre_attn_norm")(x_BTD), kv, index)
        if cache is not None:
            h_BTD, kv = h_BTD
        x_BTD = constrain(x_BTD + RMSNorm(name="post_attn_norm")(h_BTD), RESIDUAL)
        h_BTD = RMSNorm(name="pre_ffw_norm")(x_BTD)
        stats = None
        if cfg.is_moe_layer(self.layer) and cache is not None and "claimed" in cache:
            group = group or cache["k"].shape[1]  # (0: the cache's length)
            h_BTD, stats, claimed_BE = MoE(cfg, name="moe")(h_BTD, cache["claimed"], group)
            kv = {**kv, "claimed": claimed_BE}
        elif cfg.is_moe_layer(self.layer):
            h_BTD, stats = MoE(cfg, name="moe")(h_BTD)
        else:
            h_BTD = FeedForward(cfg, cfg.ffw_hidden, name="ffw")(h_BTD)
        x_BTD = constrain(x_BTD + RMSNorm(name="post_ffw_norm")(h_BTD), RESIDUAL)
        return (x_BTD, stats) if cache is None else (x_BTD, stats, kv)


def _moe_aux(cfg: ModelConfig, stats: list[dict]) -> dict[str, jax.Array]:
    """Per-layer router statistics -> forward's aux dict; {} for a dense model.

    The loss entries are means over MoE layers (so a uniform router reads 1.0);
    moe_aux_loss is the weighted *sum* over layers, ready to add to the training loss.
    """
    if not stats:
        return {}
    load_balance_L = jnp.stack([s["load_balance_loss"] for s in stats])
    z_L = jnp.stack([s["router_z_loss"] for s in stats])
    weighted_L = cfg.load_balance_weight * load_balance_L + cfg.router_z_weight * z_L
    return {
        "moe_aux_loss": jnp.sum(weighted_L),
        "load_balance_loss": jnp.mean(load_balance_L),
        "router_z_loss": jnp.mean(z_L),
        "expert_load": jnp.stack([s["expert_load"] for s in stats]),
        "dropped_fraction": jnp.mean(jnp.stack([s["dropped_fraction"] for s in stats])),
    }


REMAT_POLICIES = {
    "full": None,  # jax.checkpoint's default: save nothing but the block's inputs
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(EXPERT_MATMUL),
    ),
}


def _block_class(cfg: ModelConfig, decoding: bool):
    """Block, or Block under `jax.checkpoint` with the `cfg.remat` policy (module doc)."""
    if cfg.remat == "none" or decoding:
        return Block
    return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat])


class Transformer(nn.Module):
    """Decoder-only LM: tokens_BT -> (logits_BTV float32, aux)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BT: jax.Array, cache: list | None = None, index=0,
                 features: bool = False, group: int = 0):  # fmt: skip
        """(logits_BTV, aux), plus the updated per-layer caches if given them; `features`:
        (the final-normed residual stream x_BTD the output layer reads, aux) instead;
        `group`: a capacity MoE's routing group when decoding (decode.py)."""
        cfg = self.cfg
        embedder = Embedder(cfg, name="embedder")
        x_BTD = embedder.encode(tokens_BT)
        moe_stats, new_cache = [], []
        block_class = _block_class(cfg, decoding=cache is not None)
        for layer in range(cfg.num_layers):
            block = block_class(cfg, layer, name=f"block_{layer}")
            if cache is None:
                x_BTD, stats = block(x_BTD)
            else:
                x_BTD, stats, layer_cache = block(x_BTD, cache[layer], index, group)
                new_cache.append(layer_cache)
            if stats is not None:
                moe_stats.append(stats)
        x_BTD = RMSNorm(name="final_norm")(x_BTD)
        if features:
            return x_BTD, _moe_aux(cfg, moe_stats)
        out = embedder.decode(x_BTD), _moe_aux(cfg, moe_stats)
        return out if cache is None else (*out, new_cache)


@functools.partial(jax.jit, static_argnums=0)
def _init_boxed(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Params wrapped in flax LogicallyPartitioned boxes (value + logical axis names)."""
    return Transformer(cfg).init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Fresh parameters: a plain nested dict of float32 arrays (layout in the module doc).

    Each module's own initializers, but one random draw per parameter *kind*: the blocks of
    one kind (dense or MoE) are initialised together, vmapped over their layers' keys, so a
    jitted init holds one threefry kernel per kind instead of one per layer (gemma_2b's
    init compiles ~3x faster). Layer i's values depend only on (rng, i); threefry makes
    them the same on any mesh and backend, so every learner and the syncer build one Θ_0.
    """
    validate_model_config(cfg)
    k_embed, k_blocks, k_norm = jax.random.split(rng, 3)
    x_BTD = jnp.zeros((1, 1, cfg.d_model), jnp.float32)
    embedder = Embedder(cfg).init(k_embed, jnp.zeros((1, 1), jnp.int32), method=Embedder.encode)
    params = {"embedder": embedder["params"]}
    kinds: dict[bool, list[int]] = {}
    for layer in range(cfg.num_layers):
        kinds.setdefault(cfg.is_moe_layer(layer), []).append(layer)
    for layers in kinds.values():
        keys = jax.vmap(functools.partial(jax.random.fold_in, k_blocks))(jnp.asarray(layers))
        # Attention windows differ between layers of a kind, their parameters do not.
        block = Block(cfg, layers[0])
        stacked = jax.vmap(lambda k, b=block: b.init(k, x_BTD)["params"])(keys)
        for i, layer in enumerate(layers):
            params[f"block_{layer}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
    params["final_norm"] = RMSNorm().init(k_norm, x_BTD)["params"]
    return nn.meta.unbox(params)


def forward(cfg: ModelConfig, params: dict, tokens_BT: jax.Array) -> tuple[jax.Array, dict]:
    """logits_BTV (float32) and aux for int tokens_BT. Pure; jit with `cfg` static.

    aux is {} for a dense model; with MoE layers it holds "moe_aux_loss" (scalar, weighted sum
    over MoE layers, add it to the loss), "load_balance_loss" and "router_z_loss" (scalars, mean
    over MoE layers), "expert_load" [num_moe_layers, E] (fraction of top-k assignments per
    expert) and "dropped_fraction" (scalar, mean over MoE layers).
    """
    return Transformer(cfg).apply({"params": params}, tokens_BT)


def forward_features(cfg: ModelConfig, params: dict, tokens_BT: jax.Array):
    """(x_BTD, aux): `forward` up to the output layer, whose input x_BTD (final-normed, in the
    compute dtype) `output_logits` turns into `forward`'s logits."""
    return Transformer(cfg).apply({"params": params}, tokens_BT, features=True)


@functools.lru_cache(maxsize=16)
def param_shapes(cfg: ModelConfig) -> dict:
    """`init_params`'s tree as `jax.ShapeDtypeStruct`s, allocating nothing (cached per
    config: start-up asks for it in several places; treat it as read-only)."""
    return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def param_logical_axes(cfg: ModelConfig) -> dict:
    """Same nesting as init_params; each leaf is a tuple of logical axis names (or None), one
    per array dim, from "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert"."""
    boxed = jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0))
    return jax.tree.map(
        lambda box: tuple(box.names),
        boxed,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )


def _leaves(tree: dict, prefix: str = "") -> dict:
    """{"a/b/c": leaf} for a nested dict whose leaves are not dicts."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def count_params(cfg: ModelConfig, activated: bool = False) -> int:
    """Number of parameters (tied embedding counted once), computed from shapes only.

    activated=True counts, of each expert-stacked tensor, only the top-k experts a token uses.
    """
    validate_model_config(cfg)
    shapes = _leaves(param_shapes(cfg))
    axes = _leaves(param_logical_axes(cfg))
    total = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape.shape))
        if activated and axes[name][:1] == ("expert",):
            size = size // cfg.num_experts * cfg.experts_per_token
        total += size
    return total
