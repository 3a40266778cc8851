"""Gemma-style layers: RMSNorm, rotary embeddings, soft-capping, attention, GeGLU feed-forward.

Shape legend: B batch, T query sequence, S key sequence, D d_model, H query heads, K kv heads,
G head_dim, F ffw hidden. Every parameter is created through `param`, which records its logical
axis names next to its shape; `transformer.param_logical_axes` reads them back.

Init (all weights plain normal, fan-in scaled): attention out (H*G)**-0.5, ffw gate/up
D**-0.5, down F**-0.5 (these roughly preserve the RMS of their input); q (D*H)**-0.5 and k/v
(D*K)**-0.5, because flax's variance scaling counts the head axis into the fan-in of a
[D, heads, G] kernel: queries and keys start sqrt(H) and sqrt(K) smaller than RMS-preserving,
so attention starts close to uniform.
Norm scales start at 0 because the norms multiply by (1 + scale).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco.models.config import ModelConfig
from decoupled_diloco.sharding import constrain

# Activation shardings (sharding.constrain; the identity outside a train step's mesh): rows
# over the batch axes, heads over the tensor axis, as the weights they meet.
_HEADS = ("batch", None, "heads", None)
_KV_HEADS = ("batch", None, "kv_heads", None)
# Added to masked attention logits; finite so fully-masked rows could never produce NaN.
_MASK_VALUE = -1e30


def param(module: nn.Module, name: str, axes: tuple, shape: tuple, init) -> jax.Array:
    """A float32 parameter whose logical axis names (one per dim) travel with it."""
    if len(axes) != len(shape):
        raise ValueError(f"{name}: axes {axes} do not match shape {shape}")
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def fan_in_init(in_axis, batch_axis=()):
    """Normal init with variance 1 / fan_in, fan_in = product of the `in_axis` dims."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "normal", in_axis=in_axis, out_axis=-1, batch_axis=batch_axis
    )


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) * (1 + scale) over the last axis, computed in float32, returned in x.dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap): smooth clipping to (-cap, cap); `cap == 0` is the identity."""
    if cap <= 0:
        return x
    return cap * jnp.tanh(x / cap)


def apply_rotary(x_BTHG: jax.Array, positions_T: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding, half-split form.

    The pair (x[i], x[i + G/2]) is rotated by angle position * base**(-2i/G).
    """
    half = x_BTHG.shape[-1] // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float32) * 2.0 / x_BTHG.shape[-1])
    angle_TG = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    sin, cos = jnp.sin(angle_TG)[:, None, :], jnp.cos(angle_TG)[:, None, :]
    x1, x2 = jnp.split(x_BTHG.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTHG.dtype)


def attention_mask(q_positions_T: jax.Array, k_positions_S: jax.Array, window: int) -> jax.Array:
    """[T, S] bool: causal, and if `window > 0` only keys with q - window < k (sliding window)."""
    q, k = q_positions_T[:, None], k_positions_S[None, :]
    mask = k <= q
    if window > 0:
        mask &= k > q - window
    return mask


class RMSNorm(nn.Module):
    """RMSNorm with a (1 + scale) gain over the last axis; `axis_name` is its logical name."""

    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = param(self, "scale", (self.axis_name,), (x.shape[-1],), nn.initializers.zeros)
        return rms_norm(x, scale)


def check_cache_room(length: int, fresh: int, index) -> None:
    """ValueError if writing `fresh` positions at `index` runs past a KV cache of `length`:
    XLA moves such a write back inside it, over earlier positions' slots, while RoPE and the
    mask keep the true positions (wrong logits, no error). A traced index is the caller's to
    bound (`decode.generate` sizes the cache)."""
    if not isinstance(index, jax.core.Tracer) and int(index) + fresh > length:
        raise ValueError(f"the KV cache holds {length} positions: writing {fresh} at "
                         f"position {int(index)} runs past its end")  # fmt: skip


class Attention(nn.Module):
    """Causal self-attention, MHA / GQA / MQA, optional QK-norm, logit softcap, sliding window.

    With `cache` ({"k", "v": [B, S, K, G]} of the S positions so far, and `index`, where the
    T new tokens start) the new keys and values are written into it and the queries attend
    to every cached position up to their own: incremental decoding. Returns (out, cache).
    """

    cfg: ModelConfig
    window: int  # 0: global attention

    @nn.compact
    def __call__(self, x_BTD: jax.Array, cache: dict | None = None, index=0):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        D, H, K, G = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        in_init = fan_in_init(in_axis=0, batch_axis=())
        q = param(self, "q", ("embed", "heads", "head_dim"), (D, H, G), in_init)
        k = param(self, "k", ("embed", "kv_heads", "head_dim"), (D, K, G), in_init)
        v = param(self, "v", ("embed", "kv_heads", "head_dim"), (D, K, G), in_init)
        out = param(self, "out", ("heads", "head_dim", "embed"), (H, G, D), fan_in_init((0, 1)))

        x_BTD = x_BTD.astype(dtype)
        q_BTHG = constrain(jnp.einsum("BTD,DHG->BTHG", x_BTD, q.astype(dtype)), _HEADS)
        k_BTKG = constrain(jnp.einsum("BTD,DKG->BTKG", x_BTD, k.astype(dtype)), _KV_HEADS)
        v_BTKG = constrain(jnp.einsum("BTD,DKG->BTKG", x_BTD, v.astype(dtype)), _KV_HEADS)
        if cfg.qk_norm:
            q_BTHG = RMSNorm("head_dim", name="q_norm")(q_BTHG)
            k_BTKG = RMSNorm("head_dim", name="k_norm")(k_BTKG)
        positions_T = index + jnp.arange(x_BTD.shape[1])
        q_BTHG = apply_rotary(q_BTHG, positions_T, cfg.rope_base) * jnp.asarray(G**-0.5, dtype)
        k_BTKG = apply_rotary(k_BTKG, positions_T, cfg.rope_base)
        if cache is None:
            k_BSKG, v_BSKG, positions_S = k_BTKG, v_BTKG, positions_T
        else:
            check_cache_room(cache["k"].shape[1], x_BTD.shape[1], index)
            start = (0, index, 0, 0)
            k_BSKG = jax.lax.dynamic_update_slice(
                cache["k"], k_BTKG.astype(cache["k"].dtype), start
            )
            v_BSKG = jax.lax.dynamic_update_slice(
                cache["v"], v_BTKG.astype(cache["v"].dtype), start
            )
            cache = {"k": k_BSKG, "v": v_BSKG}
            k_BSKG, v_BSKG = k_BSKG.astype(dtype), v_BSKG.astype(dtype)
            positions_S = jnp.arange(k_BSKG.shape[1])  # slot s holds position s
        mask_TS = attention_mask(positions_T, positions_S, self.window)
        if cfg.attention_impl == "dot_product_attention":
            mixed_BTHG = fused_attention(
                q_BTHG, k_BSKG, v_BSKG, mask_TS, self.window, aligned=cache is None
            )
        else:
            mixed_BTHG = reference_attention(
                q_BTHG, k_BSKG, v_BSKG, mask_TS, cfg.attn_logit_softcap
            )
        result = jnp.einsum("BTHG,HGD->BTD", mixed_BTHG, out.astype(dtype))
        return result if cache is None else (result, cache)


def reference_attention(q_BTHG, k_BSKG, v_BSKG, mask_TS, cap: float) -> jax.Array:
    """Attention of already-scaled queries as plain einsums (`model.attention_impl` "xla"):
    logits in float32, softcapped by `cap`, masked by mask_TS [T, S] (True = may attend)."""
    B, T, H, G = q_BTHG.shape
    K, dtype = k_BSKG.shape[2], q_BTHG.dtype
    # GQA: each kv head serves R = H // K consecutive query heads; the queries are grouped
    # by kv head instead of the keys and values being repeated H // K times.
    q_BTKRG = q_BTHG.reshape(B, T, K, H // K, G)
    logits_BKRTS = jnp.einsum(
        "BTKRG,BSKG->BKRTS", q_BTKRG, k_BSKG, preferred_element_type=jnp.float32
    )
    logits_BKRTS = softcap(logits_BKRTS, cap)
    # Causal: slots after a query's own position (not yet written) are masked too.
    logits_BKRTS = jnp.where(mask_TS, logits_BKRTS, _MASK_VALUE)
    probs_BKRTS = jax.nn.softmax(logits_BKRTS, axis=-1).astype(dtype)
    return jnp.einsum("BKRTS,BSKG->BTKRG", probs_BKRTS, v_BSKG).reshape(B, T, H, G)


def fused_attention(q_BTHG, k_BSKG, v_BSKG, mask_TS, window: int, aligned: bool) -> jax.Array:
    """The same attention through `jax.nn.dot_product_attention` (`model.attention_impl`
    "dot_product_attention"); no softcap (validation requires attn_logit_softcap = 0).

    `aligned`: queries and keys are the same positions (training, prefill without a cache);
    the mask is then passed as is_causal + a (window - 1, 0) local window, the form cuDNN's
    fused kernel takes, used on GPU for 16-bit inputs (it accepts no float32). Elsewhere
    jax 0.10.2 runs its XLA implementation (implementation=None does not pick cuDNN by
    itself; TPU's fused kernel, splash attention, is a Pallas kernel that this does not
    call). GQA is native: each kv head serves H // K consecutive query heads, as above.
    """
    if aligned:
        window_arg = (window - 1, 0) if window > 0 else None
        masks = dict(is_causal=True, local_window_size=window_arg)
        on_gpu = jax.default_backend() == "gpu"
        impl = "cudnn" if on_gpu and q_BTHG.dtype in (jnp.bfloat16, jnp.float16) else None
    else:  # decoding against a cache: query positions start at `index`
        masks, impl = dict(mask=mask_TS[None, None]), None
    return jax.nn.dot_product_attention(
        q_BTHG, k_BSKG, v_BSKG, scale=1.0, implementation=impl, **masks
    )


def geglu(x_BTD, gate_DF, up_DF, down_FD) -> jax.Array:
    """(gelu(x W_gate) * (x W_up)) W_down, tanh-approximate gelu as in Gemma."""
    hidden_BTF = jax.nn.gelu(x_BTD @ gate_DF, approximate=True) * (x_BTD @ up_DF)
    return constrain(hidden_BTF, ("batch", None, "mlp")) @ down_FD


class FeedForward(nn.Module):
    """Dense GeGLU. Params "gate", "up" [D, F] and "down" [F, D] (separate, not fused)."""

    cfg: ModelConfig
    hidden: int

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        D, F, dtype = self.cfg.d_model, self.hidden, jnp.dtype(self.cfg.dtype)
        gate = param(self, "gate", ("embed", "mlp"), (D, F), fan_in_init(0))
        up = param(self, "up", ("embed", "mlp"), (D, F), fan_in_init(0))
        down = param(self, "down", ("mlp", "embed"), (F, D), fan_in_init(0))
        return geglu(x_BTD.astype(dtype), gate.astype(dtype), up.astype(dtype), down.astype(dtype))
