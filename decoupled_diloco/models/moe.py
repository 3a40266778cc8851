"""Mixture-of-experts feed-forward: top-k routing, capacity-limited dispatch, router losses.

Shape legend as in layers.py, plus E experts, C expert capacity (buffer slots per expert and
group) and k = experts_per_token (top-k choices of one token).

Grouping: each batch row is one routing group of T tokens, so capacity, token dropping and the
dispatch/combine masks ([B, T, E, C]) are per row. This keeps the masks O(B * T^2 * k) instead of
O((B*T)^2 * k) and never moves tokens across the batch (data-parallel) axis.

Dispatch is GShard/Switch style with one-hot masks and einsums (no Python loop over experts).
Within a group, assignments claim buffer slots in priority order: every token's first choice
before any token's second choice, ties by position. Assignments beyond capacity are dropped;
their gate weight is not renormalised, so a fully dropped token passes through the residual
only. Dropless mode (capacity_factor <= 0) sets C = T, enough for any routing since a token
picks an expert at most once; it costs O(B * T^2 * E) mask memory, fine at test scale.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from decoupled_diloco.models.config import ModelConfig
from decoupled_diloco.models.layers import FeedForward, fan_in_init, param


def expert_capacity(group_size: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert and group: ceil(cf * tokens * k / E), at most tokens; <= 0 -> dropless."""
    if capacity_factor <= 0:
        return group_size
    return min(group_size, math.ceil(capacity_factor * group_size * k / num_experts))


def route_top_k(router_logits_BTE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token and their gates: softmax over the k chosen logits.

    Returns gates_BTk (float32, sums to 1 over k) and experts_BTk (int32, best first).
    """
    top_logits_BTk, experts_BTk = jax.lax.top_k(router_logits_BTE, k)
    return jax.nn.softmax(top_logits_BTk, axis=-1), experts_BTk


def dispatch_and_combine(
    experts_BTk: jax.Array, gates_BTk: jax.Array, num_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One-hot routing masks for a capacity of `capacity` slots per expert and batch row.

    Returns dispatch_BTEC (float32 0/1: token t goes to slot c of expert e), combine_BTEC
    (dispatch weighted by the gates) and kept_BTk (bool: the assignment got a slot).
    """
    B, T, k = experts_BTk.shape
    choice_BTkE = jax.nn.one_hot(experts_BTk, num_experts, dtype=jnp.int32)
    # Rank-major order so first choices claim slots before second choices.
    choice_BXE = choice_BTkE.transpose(0, 2, 1, 3).reshape(B, k * T, num_experts)
    slot_BXE = jnp.cumsum(choice_BXE, axis=1) - 1
    slot_BTkE = slot_BXE.reshape(B, k, T, num_experts).transpose(0, 2, 1, 3)
    slot_BTk = jnp.sum(slot_BTkE * choice_BTkE, axis=-1)
    kept_BTk = slot_BTk < capacity
    slot_onehot_BTkC = jax.nn.one_hot(slot_BTk, capacity) * kept_BTk[..., None]
    choice_f_BTkE = choice_BTkE.astype(jnp.float32)
    dispatch_BTEC = jnp.einsum("BTkE,BTkC->BTEC", choice_f_BTkE, slot_onehot_BTkC)
    combine_BTEC = jnp.einsum("BTk,BTkE,BTkC->BTEC", gates_BTk, choice_f_BTkE, slot_onehot_BTkC)
    return dispatch_BTEC, combine_BTEC, kept_BTk


def router_statistics(
    router_logits_BTE: jax.Array, experts_BTk: jax.Array, kept_BTk: jax.Array
) -> dict[str, jax.Array]:
    """Router losses and load statistics of one MoE layer (all float32).

    load_balance_loss: Switch-style E * sum_e f_e * P_e, f_e = fraction of the top-k
      assignments routed to e (before dropping), P_e = mean router probability of e; it is 1
      under uniform routing and grows as routing concentrates.
    router_z_loss: mean over tokens of logsumexp(logits)^2; keeps router logits small.
    expert_load [E]: f_e (sums to 1). dropped_fraction: share of assignments without a slot.
    """
    num_experts = router_logits_BTE.shape[-1]
    probs_BTE = jax.nn.softmax(router_logits_BTE, axis=-1)
    choice_BTkE = jax.nn.one_hot(experts_BTk, num_experts, dtype=jnp.float32)
    load_E = jnp.mean(jnp.sum(choice_BTkE, axis=2), axis=(0, 1)) / experts_BTk.shape[-1]
    mean_prob_E = jnp.mean(probs_BTE, axis=(0, 1))
    log_z_BT = jax.nn.logsumexp(router_logits_BTE, axis=-1)
    return {
        "load_balance_loss": num_experts * jnp.sum(load_E * mean_prob_E),
        "router_z_loss": jnp.mean(log_z_BT**2),
        "expert_load": load_E,
        "dropped_fraction": jnp.mean(jnp.logical_not(kept_BTk).astype(jnp.float32)),
    }


class MoE(nn.Module):
    """Routed GeGLU experts (+ optional shared expert). Returns (y_BTD, router_statistics).

    Params: "router" [D, E] (float32 logits), experts stacked on a leading E axis: "gate",
    "up" [E, D, F], "down" [E, F, D] with F = expert_hidden; optional "shared" FeedForward.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        D, E, F, k = cfg.d_model, cfg.num_experts, cfg.expert_hidden, cfg.experts_per_token
        router = param(self, "router", ("embed", None), (D, E), fan_in_init(0))
        expert_in_init = fan_in_init(in_axis=1, batch_axis=0)
        gate = param(self, "gate", ("expert", "embed", "mlp"), (E, D, F), expert_in_init)
        up = param(self, "up", ("expert", "embed", "mlp"), (E, D, F), expert_in_init)
        down = param(self, "down", ("expert", "mlp", "embed"), (E, F, D), expert_in_init)

        # Routing decisions are precision sensitive: always float32.
        router_logits_BTE = jnp.einsum("BTD,DE->BTE", x_BTD.astype(jnp.float32), router)
        gates_BTk, experts_BTk = route_top_k(router_logits_BTE, k)
        capacity = expert_capacity(x_BTD.shape[1], k, E, cfg.capacity_factor)
        dispatch_BTEC, combine_BTEC, kept_BTk = dispatch_and_combine(
            experts_BTk, gates_BTk, E, capacity
        )

        x_BTD = x_BTD.astype(dtype)
        x_BECD = jnp.einsum("BTEC,BTD->BECD", dispatch_BTEC.astype(dtype), x_BTD)
        gate_BECF = jnp.einsum("BECD,EDF->BECF", x_BECD, gate.astype(dtype))
        up_BECF = jnp.einsum("BECD,EDF->BECF", x_BECD, up.astype(dtype))
        hidden_BECF = jax.nn.gelu(gate_BECF, approximate=True) * up_BECF
        y_BECD = jnp.einsum("BECF,EFD->BECD", hidden_BECF, down.astype(dtype))
        y_BTD = jnp.einsum("BTEC,BECD->BTD", combine_BTEC.astype(dtype), y_BECD)
        if cfg.shared_expert:
            y_BTD = y_BTD + FeedForward(cfg, F, name="shared")(x_BTD)
        return y_BTD, router_statistics(router_logits_BTE, experts_BTk, kept_BTk)
