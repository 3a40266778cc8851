"""Text generation with a KV cache: prefill, then one jitted step per new token.

    tokens_BS = generate(cfg, params, prompts, max_new_tokens=64, temperature=0.8,
                         top_k=40, rng=jax.random.key(0))

Every layer keeps the keys and values of all positions so far ([B, S, K, G], S = the longest
prompt + max_new_tokens); a step writes the new token's into slot t and attends to slots
<= t (local layers: the last `sliding_window` of them), exactly the masks of training, with
the same soft-caps and MoE routing. With expert capacity (`capacity_factor` > 0) a row is
one routing group in training, its tokens claiming expert slots in position order: the
cache carries each capacity layer's claimed slots ("claimed" [B, E]) from call to call, in
buffers sized for a group of `max(moe_group, S)` tokens, so a token is dropped exactly when
the training forward over a window of that length drops it (`sample` passes the run's
`data.seq_len`: a sample within it is routed as training routed). Prompts of different
lengths share one batch: the common prefix is prefilled in one pass, then every sequence
advances one position per step, taking its own prompt token while it has one and its
sample after that.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco.host_memory import available_host_bytes
from decoupled_diloco.models.config import ModelConfig
from decoupled_diloco.models.layers import check_cache_room
from decoupled_diloco.models.transformer import Transformer


def cache_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
    """Bytes of the caches `init_cache` makes."""
    per_layer = 2 * batch * length * cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * per_layer * jnp.dtype(cfg.dtype).itemsize


def free_bytes(device: jax.Device) -> int | None:
    """Memory still free for new buffers on the device: its allocator's limit less what is
    in use, or the host's available memory for a CPU device (None where neither is known)."""
    if device.platform == "cpu":
        return available_host_bytes()
    stats = device.memory_stats()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return None


def init_cache(cfg: ModelConfig, batch: int, length: int) -> list[dict]:
    """Empty per-layer caches {"k", "v": [B, S, K, G]} in the compute dtype, and a capacity
    MoE layer's slots claimed so far, "claimed": [B, E] int32 zeros."""
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    caches = []
    for layer in range(cfg.num_layers):
        cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
        if cfg.is_moe_layer(layer) and cfg.capacity_factor > 0:
            cache["claimed"] = jnp.zeros((batch, cfg.num_experts), jnp.int32)
        caches.append(cache)
    return caches


def _apply(cfg: ModelConfig, params: dict, tokens_BT: jax.Array, cache: list, index,
           group: int = 0):  # fmt: skip
    logits_BTV, _, cache = Transformer(cfg).apply(
        {"params": params}, tokens_BT, cache, index, group=group
    )
    return logits_BTV, cache


_decode_step = jax.jit(_apply, static_argnums=(0, 5), donate_argnums=3)


def decode_step(cfg: ModelConfig, params: dict, tokens_BT, cache: list, index, group: int = 0):
    """Logits of the T tokens written at positions index..index+T-1, and the new cache
    (`cache` is donated); `group`: a capacity MoE's routing group (the module doc; 0: the
    cache's length). ValueError if they do not fit the cache (`layers.check_cache_room`,
    checked here: inside the jitted step the index is traced)."""
    check_cache_room(cache[0]["k"].shape[1], tokens_BT.shape[1], index)
    return _decode_step(cfg, params, tokens_BT, cache, index, group)


def sample_token(logits_BV: jax.Array, rng, temperature: float, top_k: int,
                 vocab: int = 0) -> jax.Array:  # fmt: skip
    """Greedy (temperature 0) or a sample from softmax(logits / temperature) over the top k
    (top_k 0: all); int32 [B]. `vocab` > 0: only ids below it (the tokenizer's; a model's
    embedding may be padded past it, `model.vocab_size`, and its rows there are no token)."""
    if 0 < vocab < logits_BV.shape[-1]:
        logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab, logits_BV, -jnp.inf)
    if temperature < np.finfo(np.float32).tiny:  # 0, or 0 once in float32: greedy
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    # From the maximum down: a tiny temperature takes the others to -inf, never the top
    # ones to +inf (where they all tied, and the lowest id won over the greedy token).
    logits_BV = (logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    return jax.random.categorical(rng, logits_BV).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 8, 9), donate_argnums=3)
def _next(cfg, params, token_B, cache, temperature, top_k, index, rng, vocab, group):
    logits_BTV, cache = _apply(cfg, params, token_B[:, None], cache, index, group)
    return sample_token(logits_BTV[:, -1], rng, temperature, top_k, vocab), cache


def generate(
    cfg: ModelConfig,
    params: dict,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    rng=None,
    vocab: int = 0,
    moe_group: int = 0,
) -> np.ndarray:
    """Token ids [B, longest prompt + max_new_tokens]: every row its prompt, then samples
    (a shorter prompt gets the more of them) among the ids below `vocab` (0: every id the
    model has). `moe_group`: the routing group a capacity MoE's buffers are sized for,
    training's `data.seq_len` (the module doc; a row longer than it: the row's length)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rng = jax.random.key(0) if rng is None else rng
    # On the device once: host arrays would be copied to it again by every step's call
    # (all the parameters per token).
    params = jax.device_put(params)
    lengths = np.array([len(p) for p in prompts])
    total = int(lengths.max()) + max_new_tokens
    start = int(lengths.min())
    group = max(moe_group, total) if cfg.capacity_factor > 0 and cfg.num_experts else 0
    prefill = _checked_prefill(cfg, params, len(prompts), start, total, group)
    forced = np.zeros((len(prompts), total), np.int32)
    for b, p in enumerate(prompts):
        forced[b, : len(p)] = p
    cache = init_cache(cfg, len(prompts), total)
    logits_BTV, cache = prefill(params, jnp.asarray(forced[:, :start]), cache, 0)
    out = forced.copy()
    rng, key = jax.random.split(rng)
    token = np.asarray(sample_token(logits_BTV[:, -1], key, temperature, top_k, vocab))
    for t in range(start, total):
        # Position t: a prompt token while the prompt lasts, else the sample.
        token = np.where(t < lengths, forced[:, t], token).astype(np.int32)
        out[:, t] = token
        if t == total - 1:
            break
        rng, key = jax.random.split(rng)
        token, cache = _next(cfg, params, jnp.asarray(token), cache, temperature, top_k, t, key,
                             vocab, group)  # fmt: skip
        token = np.asarray(token)
    return out


def _checked_prefill(cfg: ModelConfig, params: dict, batch: int, start: int, total: int,
                     group: int = 0):  # fmt: skip
    """`decode_step` compiled for the prefill of `start` positions of a cache of `total`,
    after checking that XLA's plan of it (the KV cache, the prompts' attention scores and
    logits; the parameters already in place left out) fits the memory free on the device:
    ValueError naming both if not (on the CPU the OS would kill the process instead)."""
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, total))
    tokens = jax.ShapeDtypeStruct((batch, start), jnp.int32)
    compiled = _decode_step.lower(cfg, params, tokens, cache, 0, group).compile()
    plan = compiled.memory_analysis()
    have = free_bytes(jax.devices()[0])
    if plan is None or have is None:
        return compiled
    resident = sum(x.nbytes for x in jax.tree.leaves(params))
    need = (plan.argument_size_in_bytes + plan.output_size_in_bytes + plan.temp_size_in_bytes
            - plan.alias_size_in_bytes - resident)  # fmt: skip
    if need > have:
        raise ValueError(
            f"{batch} sequence(s) of up to {total} tokens need {need / 2**30:.1f} GiB (XLA's "
            f"plan: a {cache_bytes(cfg, batch, total) / 2**30:.1f} GiB KV cache, the prompts' "
            f"attention and logits), more than the {have / 2**30:.1f} GiB free on the "
            f"{jax.devices()[0].platform}: fewer new tokens, shorter prompts, or fewer "
            "prompts or samples"
        )
    return compiled
