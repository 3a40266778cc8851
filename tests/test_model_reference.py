"""Model layers against independent float64 numpy references and hand-computed values.

The references are written from the definitions (Gemma 2 attention, GeGLU, tied embeddings),
with loops where that is clearer, and share no code with `decoupled_diloco.models`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco.models import forward, get_model_config, init_params
from decoupled_diloco.models.layers import Attention, FeedForward
from decoupled_diloco.models.transformer import Embedder


def np_rms_norm(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + scale)


def np_rotary(x_TG, base):
    """Rotate the pair (x[i], x[i + G/2]) of position t by the angle t * base**(-2i/G)."""
    T, G = x_TG.shape
    out = np.empty_like(x_TG)
    for t in range(T):
        for i in range(G // 2):
            angle = t * base ** (-2.0 * i / G)
            a, b = x_TG[t, i], x_TG[t, i + G // 2]
            out[t, i] = a * np.cos(angle) - b * np.sin(angle)
            out[t, i + G // 2] = b * np.cos(angle) + a * np.sin(angle)
    return out


def np_attention(cfg, p, x_TD, window):
    """One sequence through Gemma-style attention, head by head and query by query."""
    T = x_TD.shape[0]
    H, K, G = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    y_TD = np.zeros_like(x_TD)
    for h in range(H):
        kv = h // (H // K)  # GQA: query heads [kv * H/K, (kv + 1) * H/K) share kv head `kv`
        q_TG, k_TG, v_TG = x_TD @ p["q"][:, h], x_TD @ p["k"][:, kv], x_TD @ p["v"][:, kv]
        if cfg.qk_norm:
            q_TG = np_rms_norm(q_TG, p["q_norm"]["scale"])
            k_TG = np_rms_norm(k_TG, p["k_norm"]["scale"])
        q_TG = np_rotary(q_TG, cfg.rope_base) / np.sqrt(G)
        k_TG = np_rotary(k_TG, cfg.rope_base)
        for t in range(T):
            visible = [s for s in range(T) if s <= t and (window == 0 or s > t - window)]
            logits = np.array([q_TG[t] @ k_TG[s] for s in visible])
            if cfg.attn_logit_softcap > 0:
                cap = cfg.attn_logit_softcap
                logits = cap * np.tanh(logits / cap)
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            mixed_G = sum(w * v_TG[s] for w, s in zip(probs, visible, strict=True))
            y_TD[t] += mixed_G @ p["out"][h]
    return y_TD


def as_f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


@pytest.mark.parametrize(
    "num_kv_heads, qk_norm, softcap, window",
    [
        (2, True, 2.0, 3),  # GQA, QK-norm, a cap that bites, local window
        (1, False, 0.0, 0),  # MQA, global, no cap
        (4, True, 0.0, 0),  # MHA
    ],
)
def test_attention_equals_numpy_reference(num_kv_heads, qk_norm, softcap, window):
    cfg = get_model_config(
        "tiny",
        d_model=16,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        qk_norm=qk_norm,
        attn_logit_softcap=softcap,
        rope_base=100.0,  # fast rotation, so positions really matter over 7 tokens
    )
    module = Attention(cfg, window)
    x_BTD = jax.random.normal(jax.random.key(0), (2, 7, cfg.d_model))
    params = jax.tree.map(
        lambda b: b.unbox(),
        module.init(jax.random.key(1), x_BTD)["params"],
        is_leaf=lambda b: hasattr(b, "unbox"),
    )
    # Larger queries sharpen the softmax (without QK-norm); non-zero norm scales test (1 + s).
    params["q"] = params["q"] * 3.0
    if qk_norm:
        for seed, name in enumerate(("q_norm", "k_norm")):
            params[name]["scale"] = 0.5 * jax.random.normal(jax.random.key(seed), (cfg.head_dim,))
    y_BTD = jax.jit(module.apply)({"params": params}, x_BTD)
    p64, x64 = as_f64(params), np.asarray(x_BTD, np.float64)
    for b in range(x_BTD.shape[0]):
        np.testing.assert_allclose(y_BTD[b], np_attention(cfg, p64, x64[b], window), atol=2e-5)
    if softcap:  # the cap changes the result, so the comparison above really covers it
        uncapped_cfg = dataclasses.replace(cfg, attn_logit_softcap=0.0)
        uncapped = np_attention(uncapped_cfg, p64, x64[0], window)
        assert np.max(np.abs(uncapped - np.asarray(y_BTD[0]))) > 1e-2


def test_geglu_matches_hand_computed_value():
    # x = [1, -1]: x W_gate = [1, -1], x W_up = [2, 2].
    # gelu_tanh(1) = 0.5 * (1 + tanh(sqrt(2/pi) * (1 + 0.044715))) = 0.8411919906, and
    # gelu_tanh(-1) = gelu_tanh(1) - 1 = -0.1588080094 (gelu(z) - gelu(-z) = z).
    # hidden = [2 * 0.8411919906, 2 * -0.1588080094] = [1.6823839812, -0.3176160188].
    # y[0] = hidden @ [1, 2] = 1.6823839812 - 0.6352320376 = 1.0471519436.
    cfg = get_model_config("tiny", d_model=2)
    params = {
        "gate": jnp.array([[1.0, 0.0], [0.0, 1.0]]),
        "up": jnp.array([[2.0, 1.0], [0.0, -1.0]]),
        "down": jnp.array([[1.0, 0.5], [2.0, 0.0]]),
    }
    y = FeedForward(cfg, hidden=2).apply({"params": params}, jnp.array([[[1.0, -1.0]]]))
    # Second output: hidden @ [0.5, 0] = 0.8411919906.
    np.testing.assert_allclose(y[0, 0], [1.0471519436, 0.8411919906], rtol=1e-6)


def test_embedding_is_scaled_by_sqrt_d_model():
    cfg = get_model_config("tiny", vocab_size=5, d_model=4)
    table = jnp.arange(20.0).reshape(5, 4) / 10
    x = Embedder(cfg).apply({"params": {"embedding": table}}, jnp.array([[3, 0]]), method="encode")
    np.testing.assert_allclose(x[0], np.asarray(table)[[3, 0]] * 2.0, rtol=1e-6)  # sqrt(4) = 2


def test_output_projection_is_the_tied_embedding():
    """With every block's residual branch zeroed, logits = softcap(final_norm(E[tok] * sqrt(D))
    @ E^T): the output layer is the input embedding, transposed."""
    cfg = get_model_config("tiny", final_logit_softcap=5.0)
    params = init_params(cfg, jax.random.key(0))
    for i in range(cfg.num_layers):
        block = params[f"block_{i}"]
        block["attn"]["out"] = jnp.zeros_like(block["attn"]["out"])
        block["ffw"]["down"] = jnp.zeros_like(block["ffw"]["down"])
    params["embedder"]["embedding"] = params["embedder"]["embedding"] * 40.0  # let the cap bite
    final_scale = 0.3 * jax.random.normal(jax.random.key(1), (cfg.d_model,))
    params["final_norm"]["scale"] = final_scale
    tokens = jnp.array([[1, 7, 200, 7]])
    logits, _ = jax.jit(forward, static_argnums=0)(cfg, params, tokens)

    table = np.asarray(params["embedder"]["embedding"], np.float64)
    x_TD = table[np.asarray(tokens[0])] * np.sqrt(cfg.d_model)
    h_TD = np_rms_norm(x_TD, np.asarray(final_scale, np.float64))
    expected = 5.0 * np.tanh(h_TD @ table.T / 5.0)
    assert np.max(np.abs(h_TD @ table.T)) > 5.0  # the soft-cap is exercised
    np.testing.assert_allclose(logits[0], expected, rtol=1e-5, atol=1e-5)
