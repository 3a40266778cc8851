"""Mixture of experts: routing masks, capacity and dropping, router losses, model integration."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco.models import count_params, forward, get_model_config, init_params
from decoupled_diloco.models.layers import geglu
from decoupled_diloco.models.moe import (
    MoE,
    dispatch_and_combine,
    expert_capacity,
    route_top_k,
    router_statistics,
    top_k,
)

jit_forward = jax.jit(forward, static_argnums=0)


def moe_cfg(**overrides):
    base = dict(d_model=8, num_experts=4, experts_per_token=2, expert_hidden=16)
    return get_model_config("tiny_moe", **{**base, **overrides})


def apply_moe(cfg, x_BTD, seed=0):
    module = MoE(cfg)
    variables = jax.jit(module.init)(jax.random.key(seed), x_BTD)
    params = jax.tree.map(lambda b: b.unbox(), variables["params"], is_leaf=_is_box)
    y_BTD, stats = jax.jit(module.apply)({"params": params}, x_BTD)
    return params, y_BTD, stats


def _is_box(x):
    return hasattr(x, "unbox")


# --- routing primitives ------------------------------------------------------------------


def test_expert_capacity():
    assert expert_capacity(8, k=2, num_experts=4, capacity_factor=1.25) == 5  # ceil(5.0)
    assert expert_capacity(10, k=1, num_experts=4, capacity_factor=1.0) == 3  # ceil(2.5)
    assert expert_capacity(8, k=2, num_experts=4, capacity_factor=0.0) == 8  # dropless
    assert expert_capacity(8, k=2, num_experts=4, capacity_factor=100.0) == 8  # never > tokens
    # The rule in exact arithmetic: 1.1 * 100 / 10 is 11.000000000000002 in floats (ceil 12).
    assert expert_capacity(100, k=1, num_experts=10, capacity_factor=1.1) == 11
    assert expert_capacity(300, k=1, num_experts=10, capacity_factor=1.1) == 33


def test_top_k_matches_lax_top_k_and_breaks_ties_to_the_lower_index():
    x = jax.random.normal(jax.random.key(0), (3, 5, 6))
    for k in (1, 2, 6):
        values, indices = top_k(x, k)
        want_values, want_indices = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(indices, want_indices)
        np.testing.assert_array_equal(values, want_values)
    _, tied = top_k(jnp.array([[1.0, 3.0, 3.0, 0.0, 3.0]]), 3)
    np.testing.assert_array_equal(tied, [[1, 2, 4]])


def test_gate_rules():
    logits_BTE = jnp.array([[[2.0, 1.0, 0.0, -1.0]]])
    probs = np.exp([2.0, 1.0, 0.0, -1.0]) / np.sum(np.exp([2.0, 1.0, 0.0, -1.0]))
    gates, experts = route_top_k(logits_BTE, 2, "chosen_softmax")
    np.testing.assert_array_equal(experts, [[[0, 1]]])
    np.testing.assert_allclose(gates, [[[np.e / (np.e + 1), 1 / (np.e + 1)]]], rtol=1e-6)
    gates, experts = route_top_k(logits_BTE, 2, "full_softmax")  # Switch: no renormalising
    np.testing.assert_array_equal(experts, [[[0, 1]]])
    np.testing.assert_allclose(gates, [[probs[:2]]], rtol=1e-6)
    with pytest.raises(ValueError, match="gate rule"):
        route_top_k(logits_BTE, 2, "sigmoid")


def test_dispatch_drops_assignments_beyond_capacity():
    experts_BTk = jnp.array([[[0], [0], [0], [1]]])
    gates_BTk = jnp.ones((1, 4, 1))
    dispatch, combine, kept = dispatch_and_combine(experts_BTk, gates_BTk, 2, capacity=2)
    expected = np.zeros((1, 4, 2, 2))
    expected[0, 0, 0, 0] = expected[0, 1, 0, 1] = expected[0, 3, 1, 0] = 1  # token 2 dropped
    np.testing.assert_array_equal(dispatch, expected)
    np.testing.assert_array_equal(combine, expected)
    np.testing.assert_array_equal(kept[0, :, 0], [True, True, False, True])


def test_slots_go_in_position_order_so_no_token_depends_on_later_ones():
    # Token 0 prefers expert 0, token 1 prefers expert 1; one slot each: token 0 takes both
    # its choices, token 1 finds both full. (First choices before second choices, GShard's
    # order, gave token 1's first choice the slot token 0's second needed: whether token 0
    # kept it depended on token 1.)
    experts_BTk = jnp.array([[[0, 1], [1, 0]]])
    gates_BTk = jnp.array([[[0.7, 0.3], [0.6, 0.4]]])
    dispatch, combine, kept = dispatch_and_combine(experts_BTk, gates_BTk, 2, capacity=1)
    np.testing.assert_array_equal(kept, [[[True, True], [False, False]]])
    np.testing.assert_allclose(combine[0, :, :, 0], [[0.7, 0.3], [0.0, 0.0]])


@pytest.mark.slow  # (the default suite is kept under ~10 min on 2 cores)
def test_a_capacity_moe_models_logits_do_not_depend_on_later_tokens():
    """tiny_moe with its default capacity (k = 2, 1.25): changing the second half of a row
    moved the first half's logits by up to 0.2 (a causal LM loss that saw the future)."""
    from decoupled_diloco import models

    cfg = models.get_model_config("tiny_moe")
    assert cfg.capacity_factor > 0 and cfg.experts_per_token == 2
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    a = rng.integers(0, cfg.vocab_size, (2, 32))
    b = a.copy()
    b[:, 16:] = rng.integers(0, cfg.vocab_size, (2, 16))
    logits_a, aux = models.forward(cfg, params, jnp.asarray(a))
    logits_b, _ = models.forward(cfg, params, jnp.asarray(b))
    assert float(aux["dropped_fraction"]) > 0  # capacity binds: the case this is about
    np.testing.assert_array_equal(logits_a[:, :16], logits_b[:, :16])


def test_dispatch_slots_are_used_at_most_once_and_combine_carries_gates():
    logits_BTE = jax.random.normal(jax.random.key(0), (3, 16, 4))
    gates_BTk, experts_BTk = route_top_k(logits_BTE, 2)
    np.testing.assert_allclose(jnp.sum(gates_BTk, -1), 1.0, rtol=1e-6)
    dispatch, combine, kept = dispatch_and_combine(experts_BTk, gates_BTk, 4, capacity=6)
    assert float(jnp.max(jnp.sum(dispatch, axis=1))) <= 1.0  # per (row, expert, slot)
    assert float(jnp.max(jnp.sum(dispatch, axis=(2, 3)))) <= 2.0  # at most k per token
    kept_gate_BT = jnp.sum(gates_BTk * kept, axis=-1)
    np.testing.assert_allclose(jnp.sum(combine, axis=(2, 3)), kept_gate_BT, rtol=1e-6)


def test_load_balance_is_one_when_uniform_and_grows_when_concentrated():
    experts_BTk = jnp.array([[[0, 1], [2, 3], [0, 2], [1, 3]]])
    kept = jnp.ones((1, 4, 2), bool)
    uniform = router_statistics(jnp.zeros((1, 4, 4)), experts_BTk, kept)
    np.testing.assert_allclose(uniform["load_balance_loss"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(uniform["router_z_loss"], np.log(4.0) ** 2, rtol=1e-6)
    np.testing.assert_allclose(uniform["expert_load"], [0.25] * 4)
    assert float(uniform["dropped_fraction"]) == 0.0

    skewed_logits = jnp.tile(jnp.array([4.0, 3.0, 0.0, 0.0]), (1, 4, 1))
    skewed = router_statistics(skewed_logits, jnp.tile(jnp.array([0, 1]), (1, 4, 1)), kept)
    np.testing.assert_allclose(skewed["expert_load"], [0.5, 0.5, 0, 0])
    assert float(skewed["load_balance_loss"]) > 1.5


# --- MoE layer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shared_expert, capacity_factor, gate",
    [
        (False, 0.0, "chosen_softmax"),
        (True, 0.0, "chosen_softmax"),
        (False, 0.0, "full_softmax"),
        (False, 2.0, "chosen_softmax"),  # C = T: the capacity path cannot drop either
    ],
)
def test_all_experts_no_drops_equals_dense_softmax_mixture(shared_expert, capacity_factor, gate):
    cfg = moe_cfg(
        experts_per_token=4,
        capacity_factor=capacity_factor,
        shared_expert=shared_expert,
        moe_gate=gate,
    )
    x_BTD = jax.random.normal(jax.random.key(1), (2, 6, cfg.d_model))
    params, y_BTD, stats = apply_moe(cfg, x_BTD)
    probs_BTE = jax.nn.softmax(x_BTD @ params["router"], axis=-1)
    expected_BTD = sum(
        probs_BTE[..., e, None]
        * geglu(x_BTD, params["gate"][e], params["up"][e], params["down"][e])
        for e in range(cfg.num_experts)
    )
    if shared_expert:
        shared = params["shared"]
        expected_BTD += geglu(x_BTD, shared["gate"], shared["up"], shared["down"])
    np.testing.assert_allclose(y_BTD, expected_BTD, atol=1e-5)
    assert float(stats["dropped_fraction"]) == 0.0


def test_the_router_runs_at_full_float32_precision_on_every_backend():
    """Routing is precision sensitive: its matmul asks for HIGHEST precision, which an
    accelerator's default (one bfloat16 pass on TPU, TF32 on GPU) would not give."""
    cfg = moe_cfg(dtype="bfloat16")
    x_BTD = jnp.ones((2, 6, cfg.d_model), jnp.bfloat16)
    module = MoE(cfg)
    variables = module.init(jax.random.key(0), x_BTD)
    jaxpr = jax.make_jaxpr(module.apply)(variables, x_BTD)
    E = cfg.num_experts
    routers = [
        e
        for e in jaxpr.eqns
        if e.primitive.name == "dot_general"
        and e.outvars[0].aval.shape == (2, 6, E)
        and e.invars[1].aval.shape == (cfg.d_model, E)
    ]
    assert len(routers) == 1, [e.outvars[0].aval for e in jaxpr.eqns]
    (router,) = routers
    assert all(v.aval.dtype == jnp.float32 for v in router.invars)
    precision = router.params["precision"]
    assert precision is not None and set(precision) == {jax.lax.Precision.HIGHEST}


def test_capacity_path_equals_dropless_when_nothing_drops():
    # C = ceil(1.5 * 8 * 2 / 4) = 6 < 8 tokens, so the buffers really are smaller.
    x_BTD = jax.random.normal(jax.random.key(2), (3, 8, 8))
    _, y_capped, stats = apply_moe(moe_cfg(capacity_factor=1.5), x_BTD)
    _, y_dropless, _ = apply_moe(moe_cfg(capacity_factor=0.0), x_BTD)
    assert float(stats["dropped_fraction"]) == 0.0, "precondition: pick a seed with no drops"
    np.testing.assert_allclose(y_capped, y_dropless, atol=1e-6)


def reference_moe(cfg, params, x_BTD):
    """Per-token loop in numpy (float64): y_t = sum_j gate_tj * GeGLU_{e_tj}(x_t)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x_BTD, np.float64)

    def gelu(z):  # tanh approximation, as Gemma
        return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))

    y = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            logits = x[b, t] @ p["router"]
            chosen = np.argsort(-logits, kind="stable")[: cfg.experts_per_token]
            probs = np.exp(logits - logits.max())
            if cfg.moe_gate == "full_softmax":
                gates = probs[chosen] / probs.sum()
            else:
                gates = probs[chosen] / probs[chosen].sum()
            for g, e in zip(gates, chosen, strict=True):
                hidden = gelu(x[b, t] @ p["gate"][e]) * (x[b, t] @ p["up"][e])
                y[b, t] += g * (hidden @ p["down"][e])
    return y


@pytest.mark.parametrize(
    "k, gate", [(2, "chosen_softmax"), (1, "full_softmax"), (3, "full_softmax")]
)
def test_dropless_equals_per_token_reference_loop(k, gate):
    cfg = moe_cfg(experts_per_token=k, capacity_factor=0.0, moe_gate=gate)
    x_BTD = jax.random.normal(jax.random.key(7), (2, 5, cfg.d_model))
    params, y_BTD, stats = apply_moe(cfg, x_BTD)
    np.testing.assert_allclose(y_BTD, reference_moe(cfg, params, x_BTD), atol=1e-5)
    assert float(stats["dropped_fraction"]) == 0.0


def test_dropless_gradients_equal_the_capacity_path_without_drops():
    # Same routing, so the same function: the grouped matmuls must transpose correctly.
    x_BTD = jax.random.normal(jax.random.key(2), (3, 8, 8))
    capped, dropless = moe_cfg(capacity_factor=1.5), moe_cfg(capacity_factor=0.0)
    params, _, stats = apply_moe(capped, x_BTD)
    assert float(stats["dropped_fraction"]) == 0.0
    probe_BTD = jax.random.normal(jax.random.key(8), x_BTD.shape)

    def grads(cfg):
        def loss(p, x):
            return jnp.sum(MoE(cfg).apply({"params": p}, x)[0] * probe_BTD)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x_BTD)

    (g_capped, gx_capped), (g_dropless, gx_dropless) = grads(capped), grads(dropless)
    for name in ("router", "gate", "up", "down"):
        assert float(jnp.max(jnp.abs(g_dropless[name]))) > 0, name
        np.testing.assert_allclose(g_dropless[name], g_capped[name], atol=1e-5, err_msg=name)
    np.testing.assert_allclose(gx_dropless, gx_capped, atol=1e-5)


def test_tiny_capacity_drops_tokens():
    x_BTD = jax.random.normal(jax.random.key(3), (2, 16, 8))
    _, y_BTD, stats = apply_moe(moe_cfg(capacity_factor=0.01), x_BTD)
    # C = 1 slot per expert and row: at most 4 of 32 assignments per row survive.
    assert float(stats["dropped_fraction"]) >= 1 - 4 / 32
    assert bool(jnp.all(jnp.isfinite(y_BTD)))


# --- MoE inside the model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_moe():
    cfg = get_model_config("tiny_moe")
    return cfg, init_params(cfg, jax.random.key(0))


def test_model_aux_and_expert_load(tiny_moe):
    cfg, params = tiny_moe
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, cfg.vocab_size)
    logits, aux = jit_forward(cfg, params, tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert set(aux) == {
        "moe_aux_loss",
        "load_balance_loss",
        "router_z_loss",
        "expert_load",
        "dropped_fraction",
    }
    assert aux["expert_load"].shape == (cfg.num_layers, cfg.num_experts)
    np.testing.assert_allclose(jnp.sum(aux["expert_load"], axis=-1), 1.0, rtol=1e-6)
    per_layer = cfg.load_balance_weight * aux["load_balance_loss"]
    per_layer += cfg.router_z_weight * aux["router_z_loss"]
    np.testing.assert_allclose(aux["moe_aux_loss"], cfg.num_layers * per_layer, rtol=1e-5)


def test_zero_router_gives_load_balance_one(tiny_moe):
    cfg, params = tiny_moe
    zeroed = jax.tree.map(lambda x: x, params)
    for i in range(cfg.num_layers):
        zeroed[f"block_{i}"]["moe"]["router"] = jnp.zeros_like(params["block_0"]["moe"]["router"])
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, cfg.vocab_size)
    _, aux = jit_forward(cfg, zeroed, tokens)
    np.testing.assert_allclose(aux["load_balance_loss"], 1.0, rtol=1e-6)


def test_language_model_loss_reaches_the_router(tiny_moe):
    cfg, params = tiny_moe
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, cfg.vocab_size)

    def loss(p):  # cross-entropy only: the gradient must come through the gates
        log_probs = jax.nn.log_softmax(jit_forward(cfg, p, tokens)[0][:, :-1])
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

    grads = jax.jit(jax.grad(loss))(params)
    for i in range(cfg.num_layers):
        assert float(jnp.max(jnp.abs(grads[f"block_{i}"]["moe"]["router"]))) > 0


@pytest.mark.parametrize("capacity_factor", [1.25, 0.0])
def test_top1_switch_gate_trains_the_router_from_the_lm_loss(capacity_factor):
    cfg = get_model_config(
        "tiny_moe", experts_per_token=1, moe_gate="full_softmax", capacity_factor=capacity_factor
    )
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, cfg.vocab_size)

    def router_grads(c):  # cross-entropy only: no aux loss
        def loss(p):
            log_probs = jax.nn.log_softmax(jit_forward(c, p, tokens)[0][:, :-1])
            return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

        grads = jax.jit(jax.grad(loss))(params)
        return [grads[f"block_{i}"]["moe"]["router"] for i in range(c.num_layers)]

    for g in router_grads(cfg):
        assert float(jnp.max(jnp.abs(g))) > 0
    # What validation forbids: with one chosen expert its renormalised gate is exactly 1.
    chosen = dataclasses.replace(cfg, moe_gate="chosen_softmax")
    for g in router_grads(chosen):
        assert float(jnp.max(jnp.abs(g))) == 0.0


def test_top1_with_chosen_softmax_is_rejected_naming_the_keys():
    with pytest.raises(ValueError, match="model.experts_per_token = 1 .*model.moe_gate"):
        get_model_config("tiny_moe", experts_per_token=1)
    with pytest.raises(ValueError, match="model.moe_gate"):
        get_model_config("tiny_moe", moe_gate="sigmoid")


def test_every_other_layout_and_activated_count():
    cfg = get_model_config("tiny_moe", num_layers=4, moe_layers="every_other", shared_expert=True)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert [("moe" in params[f"block_{i}"]) for i in range(4)] == [False, True, False, True]
    assert [("ffw" in params[f"block_{i}"]) for i in range(4)] == [True, False, True, False]
    moe = params["block_1"]["moe"]
    assert moe["router"].shape == (cfg.d_model, cfg.num_experts)
    assert moe["gate"].shape == (cfg.num_experts, cfg.d_model, cfg.expert_hidden)
    assert moe["down"].shape == (cfg.num_experts, cfg.expert_hidden, cfg.d_model)
    assert set(moe["shared"]) == {"gate", "up", "down"}
    per_expert = 3 * cfg.d_model * cfg.expert_hidden
    idle = 2 * (cfg.num_experts - cfg.experts_per_token) * per_expert  # 2 MoE layers
    assert count_params(cfg, activated=True) == count_params(cfg) - idle
