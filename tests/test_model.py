"""Dense Gemma-style model: layers against hand-computed values, masking, layout, presets."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco.models import (
    PRESETS,
    count_params,
    forward,
    get_model_config,
    init_params,
    param_logical_axes,
)
from decoupled_diloco.models.layers import apply_rotary, attention_mask, rms_norm, softcap

jit_forward = jax.jit(forward, static_argnums=0)
LOGICAL_AXES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert", None}


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def cross_entropy(logits_BTV, tokens_BT):
    log_probs = jax.nn.log_softmax(logits_BTV[:, :-1])
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens_BT[:, 1:, None], axis=-1))


# --- layers ------------------------------------------------------------------------------


def test_rms_norm_matches_hand_computed():
    x = jnp.array([[3.0, 4.0], [1.0, -1.0]])
    scale = jnp.array([0.0, 1.0])
    # Row 0: rms = sqrt((9 + 16) / 2) = sqrt(12.5); row 1: rms = 1. Gains are (1, 2).
    rms0 = np.sqrt(12.5)
    expected = np.array([[3 / rms0, 2 * 4 / rms0], [1.0, -2.0]])
    np.testing.assert_allclose(rms_norm(x, scale), expected, rtol=1e-5)


def test_rotary_matches_hand_computed_rotation():
    # G = 4: pair (x0, x2) turns by position * 1, pair (x1, x3) by position * base**-0.5 = 0.1.
    x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    out = apply_rotary(x, jnp.array([2]), base=100.0).reshape(4)
    a, b = 2.0, 0.2
    expected = [
        1 * np.cos(a) - 3 * np.sin(a),
        2 * np.cos(b) - 4 * np.sin(b),
        3 * np.cos(a) + 1 * np.sin(a),
        4 * np.cos(b) + 2 * np.sin(b),
    ]
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    np.testing.assert_allclose(apply_rotary(x, jnp.array([0]), base=100.0), x)


def test_rotary_scores_depend_only_on_relative_position():
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 8))

    def score(m, n):
        return jnp.sum(apply_rotary(q, jnp.array([m]), 1e4) * apply_rotary(k, jnp.array([n]), 1e4))

    np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-4)
    assert abs(float(score(5, 2) - score(5, 4))) > 1e-3


def test_softcap():
    x = jnp.array([-100.0, -1.0, 0.0, 0.5, 100.0])
    np.testing.assert_array_equal(softcap(x, 0.0), x)
    np.testing.assert_allclose(softcap(x, 2.0), 2.0 * np.tanh(np.asarray(x) / 2.0), rtol=1e-6)
    np.testing.assert_allclose(softcap(jnp.array([100.0]), 2.0), [2.0], rtol=1e-6)


def test_attention_mask_causal_and_sliding_window():
    pos = jnp.arange(5)
    np.testing.assert_array_equal(attention_mask(pos, pos, 0), np.tril(np.ones((5, 5), bool)))
    # window 2: query i sees keys i - 1 and i.
    expected = np.tril(np.ones((5, 5), bool)) & np.triu(np.ones((5, 5), bool), -1)
    np.testing.assert_array_equal(attention_mask(pos, pos, 2), expected)


# --- whole model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    cfg = get_model_config("tiny")
    return cfg, init_params(cfg, jax.random.key(0))


def test_tiny_param_layout_contract(tiny):
    cfg, params = tiny
    per_block = [
        "pre_attn_norm/scale",
        "attn/q",
        "attn/k",
        "attn/v",
        "attn/out",
        "post_attn_norm/scale",
        "pre_ffw_norm/scale",
        "ffw/gate",
        "ffw/up",
        "ffw/down",
        "post_ffw_norm/scale",
    ]
    expected = {"embedder/embedding", "final_norm/scale"}
    expected |= {f"block_{i}/{leaf}" for i in range(2) for leaf in per_block}
    leaves = flat(params)
    assert set(leaves) == expected
    assert all(v.dtype == jnp.float32 for v in leaves.values())
    assert leaves["embedder/embedding"].shape == (cfg.vocab_size, cfg.d_model)
    assert leaves["block_0/attn/k"].shape == (cfg.d_model, cfg.num_kv_heads, cfg.head_dim)
    assert leaves["block_0/attn/out"].shape == (cfg.num_heads, cfg.head_dim, cfg.d_model)
    assert sum(v.size for v in leaves.values()) == count_params(cfg)


def test_logical_axes_cover_every_dim(tiny):
    cfg, params = tiny
    shapes = flat(params)
    axes = flat(param_logical_axes(cfg))
    assert set(axes) == set(shapes)
    for name, names in axes.items():
        assert len(names) == shapes[name].ndim, name
        assert set(names) <= LOGICAL_AXES, name
    assert axes["embedder/embedding"] == ("vocab", "embed")
    assert axes["block_1/attn/k"] == ("embed", "kv_heads", "head_dim")


def test_qk_norm_adds_head_dim_scales():
    cfg = get_model_config("tiny", qk_norm=True, num_layers=1)
    axes = flat(param_logical_axes(cfg))
    assert axes["block_0/attn/q_norm/scale"] == ("head_dim",)
    assert axes["block_0/attn/k_norm/scale"] == ("head_dim",)


def test_initial_loss_is_near_uniform(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, cfg.vocab_size)
    logits, aux = jit_forward(cfg, params, tokens)
    assert logits.shape == (4, 32, cfg.vocab_size) and logits.dtype == jnp.float32
    assert aux == {}
    loss = float(cross_entropy(logits, tokens))
    assert abs(loss - np.log(cfg.vocab_size)) < 0.5, loss


def test_causal_future_tokens_do_not_change_past_logits(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.key(2), (1, 16), 0, cfg.vocab_size)
    t = 9
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 7) % cfg.vocab_size)
    logits, _ = jit_forward(cfg, params, jnp.concatenate([tokens, changed]))
    np.testing.assert_allclose(logits[0, : t + 1], logits[1, : t + 1], atol=1e-6)
    assert float(jnp.max(jnp.abs(logits[0, t + 1 :] - logits[1, t + 1 :]))) > 1e-4


@pytest.mark.parametrize("kind", ["local", "global"])
def test_sliding_window_limits_influence(kind):
    window = 4
    cfg = get_model_config("tiny", num_layers=1, attention_pattern=(kind,), sliding_window=window)
    params = init_params(cfg, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (1, 12), 0, cfg.vocab_size)
    changed = tokens.at[:, 0].set((tokens[:, 0] + 1) % cfg.vocab_size)
    logits, _ = jit_forward(cfg, params, jnp.concatenate([tokens, changed]))
    diff_T = np.max(np.abs(np.asarray(logits[0] - logits[1])), axis=-1)
    # Query i sees keys j with i - window < j <= i: token 0 reaches positions 0 .. window - 1.
    assert np.all(diff_T[:window] > 1e-5), diff_T
    if kind == "local":
        np.testing.assert_array_less(diff_T[window:], 1e-6)
    else:
        assert np.all(diff_T[window:] > 1e-5), diff_T


def test_gqa_and_mqa_equal_mha_with_repeated_kv_heads():
    """A model with K kv heads is an MHA model whose k/v heads are repeated H / K times.

    (Self-consistency only; test_model_reference.py checks attention against numpy.)"""
    tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, 256)
    mha_cfg = get_model_config("tiny", num_heads=4, num_kv_heads=4)
    for num_kv in (2, 1):
        cfg = get_model_config("tiny", num_heads=4, num_kv_heads=num_kv)
        params = init_params(cfg, jax.random.key(6))
        widened = jax.tree.map(lambda x: x, params)
        for i in range(cfg.num_layers):
            attn = widened[f"block_{i}"]["attn"]
            for name in ("k", "v"):
                attn[name] = jnp.repeat(attn[name], 4 // num_kv, axis=1)
        logits, _ = jit_forward(cfg, params, tokens)
        mha_logits, _ = jit_forward(mha_cfg, widened, tokens)
        np.testing.assert_allclose(logits, mha_logits, atol=1e-5)


def test_every_param_gets_gradient(tiny):
    cfg, params = tiny
    tokens = jax.random.randint(jax.random.key(7), (2, 16), 0, cfg.vocab_size)
    grads = jax.jit(jax.grad(lambda p: cross_entropy(jit_forward(cfg, p, tokens)[0], tokens)))(
        params
    )
    for name, g in flat(grads).items():
        assert float(jnp.max(jnp.abs(g))) > 0, name


def test_bfloat16_compute_keeps_float32_params_and_logits(tiny):
    cfg, params = tiny
    bf16 = get_model_config("tiny", dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(8), (2, 16), 0, cfg.vocab_size)
    logits32, _ = jit_forward(cfg, params, tokens)
    logits16, _ = jit_forward(bf16, params, tokens)
    assert logits16.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in flat(init_params(bf16, jax.random.key(0))).values())
    np.testing.assert_allclose(logits16, logits32, atol=0.05)


# --- presets -----------------------------------------------------------------------------

PRESET_RANGES = {  # name -> (low, high) for total (dense) or activated (MoE) params
    "tiny": (1e5, 1.5e5),
    "tiny_moe": (1e5, 1.6e5),
    "mid": (3e7, 3.3e7),
    "gemma_2b": (2e9, 3.5e9),
    "gemma_5b": (4e9, 6e9),
    "gemma_9b": (8e9, 1.1e10),
    "moe_2p8b_active": (2.8e9 * 0.85, 2.8e9 * 1.15),
    "moe_3p8b_active": (3.8e9 * 0.85, 3.8e9 * 1.15),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_shapes_and_param_counts(preset):
    assert set(PRESET_RANGES) == set(PRESETS)
    cfg = get_model_config(preset)
    shapes = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    logits, aux = jax.eval_shape(functools.partial(forward, cfg), shapes, tokens)
    assert logits.shape == (1, 8, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(aux) == (cfg.moe_layers != "none")
    total = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    activated = count_params(cfg, activated=True)
    assert total == count_params(cfg)
    assert activated <= total
    low, high = PRESET_RANGES[preset]
    assert low <= activated <= high, f"{preset}: {activated:.4g} activated, {total:.4g} total"


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_heads=6, num_kv_heads=4), "model.num_heads (6) must be divisible"),
        (dict(attention_pattern=("global", "sparse")), "model.attention_pattern"),
        (dict(attention_pattern=("local",), sliding_window=0), "model.sliding_window"),
        (dict(head_dim=7), "model.head_dim"),
        (dict(dtype="float16"), "model.dtype"),
        (dict(d_model=0), "model.d_model"),
        (dict(moe_layers="all", num_experts=0, expert_hidden=8), "model.num_experts"),
        (
            dict(moe_layers="all", num_experts=2, experts_per_token=3, expert_hidden=8),
            "model.experts_per_token",
        ),
        (dict(moe_layers="all", num_experts=2, expert_hidden=0), "model.expert_hidden"),
        (
            dict(moe_layers="all", num_experts=2, experts_per_token=1, expert_hidden=8),
            "model.experts_per_token = 1 with model.moe_gate = 'chosen_softmax'",
        ),
        (
            dict(moe_layers="all", num_experts=2, expert_hidden=8, moe_gate="softmax"),
            "model.moe_gate",
        ),
        (dict(moe_layers="some"), "model.moe_layers"),
        (dict(not_a_field=1), "not_a_field"),
        # a value of the wrong type (from Python: the CLI's flags are typed) failed late
        (dict(d_model=64.5), "model.d_model (64.5) must be an int"),
        (dict(num_layers=True), "model.num_layers (True) must be an int"),
        (dict(qk_norm=1), "model.qk_norm (1) must be a bool"),
        (dict(dtype=None), "model.dtype (None) must be a string"),
        (dict(capacity_factor="1.25"), "model.capacity_factor ('1.25') must be a number"),
    ],
)
def test_bad_config_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        get_model_config("tiny", **overrides)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="gemma_3b"):
        get_model_config("gemma_3b")


def test_overrides_accept_lists_for_pattern():
    cfg = get_model_config("tiny", attention_pattern=["global"])
    assert cfg.attention_pattern == ("global",)
    hash(cfg)  # usable as a jit static argument


# --- initial parameters ----------------------------------------------------------------------


def _random_kernels(jaxpr) -> int:
    """How many random draws a jaxpr holds, nested jaxprs (jit, vmap'd bodies) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "random_bits"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _random_kernels(inner)
    return count


def test_init_draws_once_per_parameter_kind_not_per_layer():
    """Blocks of one kind are initialised by one vmapped draw: the init's size (and compile
    time: gemma_2b's 26 layers) does not grow with depth."""
    kinds = []
    for layers in (2, 8):
        cfg = get_model_config("tiny_moe", num_layers=layers, moe_layers="every_other")
        jaxpr = jax.make_jaxpr(functools.partial(init_params, cfg))(jax.random.key(0))
        kinds.append(_random_kernels(jaxpr.jaxpr))
    assert kinds[0] == kinds[1] > 0


@pytest.mark.slow  # (the default suite is kept under ~10 min on 2 cores)
def test_init_layers_differ_and_depend_only_on_seed_and_index():
    shallow = flat(init_params(get_model_config("tiny", num_layers=2), jax.random.key(3)))
    deep = flat(init_params(get_model_config("tiny", num_layers=4), jax.random.key(3)))
    for name, value in shallow.items():  # a deeper model keeps the shallow one's layers
        np.testing.assert_array_equal(deep[name], value, err_msg=name)
    for leaf in ("attn/q", "ffw/up"):  # distinct layers are distinct draws
        assert not np.allclose(deep[f"block_0/{leaf}"], deep[f"block_2/{leaf}"])
    other = flat(init_params(get_model_config("tiny", num_layers=2), jax.random.key(4)))
    assert not np.allclose(other["block_0/attn/q"], shallow["block_0/attn/q"])


def test_init_on_a_sharded_mesh_equals_the_host_init():
    """Every learner (its own mesh) and the syncer (one host device) start from one Θ_0."""
    from decoupled_diloco import sharding

    cfg = get_model_config("tiny")
    mesh = sharding.make_mesh(jax.devices()[:4], sharding.MeshConfig(data=1, fsdp=2, tensor=2))
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    shardings = sharding.param_shardings(abstract, param_logical_axes(cfg), mesh)
    placed = jax.jit(lambda r: init_params(cfg, r), out_shardings=shardings)(jax.random.key(5))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[7])
    single = jax.jit(lambda r: init_params(cfg, r), out_shardings=one)
    host = flat(jax.device_get(single(jax.random.key(5))))
    for name, value in flat(placed).items():
        np.testing.assert_array_equal(np.asarray(value), host[name], err_msg=name)
