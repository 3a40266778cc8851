"""Syncer math: merge weights, merge rules (mean, RDA), the fused merge + outer step, and
the divergence of the learners' MoE routers (a merge diagnostic).

Arrays are dicts {leaf name: np.ndarray}; all math is float32 except scalar reductions
(norms, weights), which accumulate in float64. Norms are per tensor (per leaf). Loops walk
tensors in cache-sized chunks (`chunks.py`); `merge_outer_step` computes
`outer.outer_step(theta, scale · merge(vs, w, rule), ...)` without materialising Δ, and in
place if asked: the syncer's fast path. With scale = 1 it makes the same float32 operations,
so the same bits. Another scale it folds into the merge's coefficients (one rounding where
the composition rounds Δ, then scale · Δ): the two then agree to float32 rounding, a few
ulps of the largest term summed into each value, not bit for bit.

Nothing here mutates its inputs unless called with `inplace=True`: the syncer may still
hold (or be sending, or checkpointing) the arrays it passes in.

How far a merge moves Θ (`weigh`). An offer's outer gradient v_m holds all the learner's
unmerged work, so its size grows with its step count. With normalize = "roster" (default)
each offer gets a per-learner coefficient q_m / Q, Q summing q over the roster (the live
learners whose work reaches Θ, `registry.py`), merged or not: every step of work then
enters Θ with the same coefficient whichever merge carries it (a learner's late work rides
along with the next round at full value, and a merge of one learner in four moves Θ a
quarter as far as a full round), and a full round is exactly the paper's weighted merge.
q_m = (tokens per step)² for "tokens" (the paper's w = c_tokens²/c_steps per H-step offer,
with its quantity factor c_steps carried by v_m itself), 1 for "uniform". normalize =
"merged" is the paper's formula taken literally: weights c_tokens²/c_steps normalised over
the merged offers, so a merge of one learner moves Θ as far as a round of all of them and
work counts with weight ∝ its size.

RDA normalises each offer (φ(v_m) = v_m/‖v_m‖), so there the quantity v_m carries is gone
from the direction: its direction weights are q_m · c_steps (`direction_weights`; the
paper's c_tokens²/c_steps for "tokens"), while its radius stays Σ q_m‖v_m‖ / Q, linear in
each offer's norm as the mean is in v_m. A 1-step offer merged beside an H-step one then
turns Θ's step by its share of the work, not by half (with q_m alone both directions
weighed the same, and one step of work moved Θ about twice its own norm).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from decoupled_diloco.diloco import outer
from decoupled_diloco.diloco.chunks import F32 as _F32
from decoupled_diloco.diloco.chunks import (
    Scratch,
    check_same_leaves,
    sq_norm,
    weighted_sum,
)

WEIGHTINGS = ("tokens", "uniform")
NORMALIZATIONS = ("roster", "merged")
RULES = ("rda", "mean")
# RDA's direction u = Σ d̂_m φ(v_m) has ‖u‖ <= Σ d̂_m = 1, and ‖u‖ -> 0 as the offers'
# directions cancel. Its float32 value is off by at most M + 1 half-ulps of Σ|d̂_m φ(v_m)|
# per element (φ's coefficient, M products, M − 1 sums): ‖error‖ <= (M + 1) · 2^-24 · Σ d̂_m
# over the nonzero offers, whatever their length. One 2^-24 more each for the offers' norms
# (`chunks.sq_norm`: ~1e-8 relative) and for the offers' own float32 rounding. A u shorter
# than 8x that, `_U_NOISE` · (M + 3) · Σ d̂_m (2.4e-6 for two offers; cancelling offers
# measured ~40x below it), is noise: scaled up to the radius it would step Θ an offer's full
# length in a direction no offer took, so RDA's Δ is 0 there.
_U_NOISE = 8 * 2.0**-24


def token_weights(
    c_tokens: Sequence[float], c_steps: Sequence[float], mode: str = "tokens"
) -> np.ndarray:
    """Per-learner merge weights [M], float64.

    "tokens": w = c_tokens² / c_steps (quantity × quality: tokens seen times tokens per
    step); "uniform": w = 1. Learners with c_steps == 0 did no work and get 0 in both modes.
    """
    if mode not in WEIGHTINGS:
        raise ValueError(f"diloco.weights={mode!r}; expected one of {WEIGHTINGS}")
    tokens, steps = np.asarray(c_tokens, np.float64), np.asarray(c_steps, np.float64)
    if tokens.shape != steps.shape or tokens.ndim != 1:
        raise ValueError(f"c_tokens {tokens.shape} and c_steps {steps.shape} must be equal 1-D")
    if not (np.all(np.isfinite(tokens)) and np.all(np.isfinite(steps))):
        raise ValueError("c_tokens and c_steps must be finite")
    if np.any(tokens < 0) or np.any(steps < 0):
        raise ValueError("c_tokens and c_steps must be >= 0")
    active = steps > 0
    if mode == "uniform":
        return active.astype(np.float64)
    return np.where(active, tokens**2 / np.where(active, steps, 1.0), 0.0)


def learner_weight(tokens_per_step: float, mode: str) -> float:
    """q_m, a learner's coefficient per offer under normalize = "roster" (module docstring)."""
    if mode not in WEIGHTINGS:
        raise ValueError(f"diloco.weights={mode!r}; expected one of {WEIGHTINGS}")
    return float(tokens_per_step) ** 2 if mode == "tokens" else 1.0


def direction_weights(
    c_tokens: Sequence[float], c_steps: Sequence[float], mode: str, normalize: str
) -> np.ndarray:
    """RDA's direction weights [M] for offers with these counters (module docstring): the
    work each offer holds, q_m · c_steps, under "roster" (c_tokens²/c_steps for "tokens",
    c_steps for "uniform"); the merge weights themselves under "merged"."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"diloco.normalize={normalize!r}; expected one of {NORMALIZATIONS}")
    w = token_weights(c_tokens, c_steps, mode)
    if normalize == "roster" and mode == "uniform":
        return np.where(w > 0, np.asarray(c_steps, np.float64), 0.0)
    return w


def weigh(
    c_tokens: Sequence[float],
    c_steps: Sequence[float],
    mode: str,
    normalize: str,
    sync_every: int,
    others: Sequence[float] = (),
) -> tuple[np.ndarray, float, float]:
    """(w, scale, work) for a merge of offers with these counters (module docstring).

    w: the offers' weights within the rule (normalised there); scale: Δ = scale ·
    rule(v, w); work: rounds of work the merge carries (the momentum clock, `outer.py`).
    `others`: q of the roster's learners with no offer in this merge ("roster" only).
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"diloco.normalize={normalize!r}; expected one of {NORMALIZATIONS}")
    w = token_weights(c_tokens, c_steps, mode)
    if normalize == "merged":
        return w, 1.0, 1.0
    steps = np.asarray(c_steps, np.float64)
    per_step = np.asarray(c_tokens, np.float64) / np.where(steps > 0, steps, 1.0)
    q = np.array(
        [learner_weight(b, mode) if n > 0 else 0.0 for b, n in zip(per_step, steps, strict=True)]
    )
    total = float(q.sum()) + float(np.sum(others))
    if total <= 0:
        return q, 0.0, 0.0
    return q, float(q.sum()) / total, float(q @ steps) / (max(sync_every, 1) * total)


def outer_gradient(anchor: dict, local: dict) -> dict:
    """v = anchor − local per leaf, float32 (the DiLoCo outer gradient)."""
    check_same_leaves([anchor, local])
    return {k: np.subtract(anchor[k], local[k], dtype=_F32) for k in anchor}


def offer_sq_norms(v: dict) -> dict[str, float]:
    """‖v_k‖² per leaf of one offer; non-finite if any value is (or the sum overflows).

    RDA needs these before it can merge. A syncer that computes them when an offer
    arrives (doubling as its finiteness check) and passes them as `sq_norms` takes one
    of RDA's two read passes over the offers off the merge's critical path.
    """
    return {k: sq_norm(x) for k, x in v.items()}


def _contributors(vs: list[dict], w, sq_norms=None) -> tuple[list[dict], np.ndarray, list]:
    """Validates offers and weights; keeps offers with w > 0 and normalises w to sum 1.

    Returns (kept offers, their normalised weights, their `sq_norms` entries or Nones).
    """
    kept, w_hat, norms, _ = _contributors_with(vs, w, sq_norms, None)
    return kept, w_hat, norms


def _contributors_with(vs: list[dict], w, sq_norms, direction):
    """`_contributors`, and the kept offers' `direction` weights normalised to sum 1 (the
    normalised w where `direction` is None)."""
    if not vs:
        raise ValueError("merge needs at least one offer")
    w = np.asarray(w, np.float64)
    if w.shape != (len(vs),):
        raise ValueError(f"weights shape {w.shape} != ({len(vs)},)")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be finite and >= 0, got {w}")
    if w.sum() <= 0:
        raise ValueError("no offer has a positive weight")
    check_same_leaves(vs)
    if sq_norms is not None and len(sq_norms) != len(vs):
        raise ValueError(f"sq_norms has {len(sq_norms)} entries for {len(vs)} offers")
    keep = np.flatnonzero(w > 0)
    norms = [None if sq_norms is None else sq_norms[i] for i in keep]
    w_hat = w[keep] / w[keep].sum()
    if direction is None:
        return [vs[i] for i in keep], w_hat, norms, w_hat
    d = np.asarray(direction, np.float64)
    if d.shape != w.shape or not np.all(np.isfinite(d)) or np.any(d[keep] <= 0):
        raise ValueError(f"direction weights must be finite and > 0 where w > 0, got {d}")
    return [vs[i] for i in keep], w_hat, norms, d[keep] / d[keep].sum()


def merge_mean(vs: list[dict], w: np.ndarray) -> dict:
    """Weighted mean Σ w_m v_m / Σ w_m per leaf, float32."""
    vs, w_hat, _ = _contributors(vs, w)
    return {k: weighted_sum([v[k] for v in vs], w_hat)[0] for k in vs[0]}


def _rda_direction(
    leaves: list, w_hat, eps: float, sq_norms: list, threads: int | None = 1,
    scratch: Scratch | None = None, d_hat=None,
) -> tuple[np.ndarray, float]:  # fmt: skip
    """(u, scale) with RDA's Δ = scale · u for one leaf.

    u = Σ d̂_m φ(v_m) is the weighted mean direction (d̂: the direction weights, ŵ if None;
    a new float32 array, or a view into `scratch`) and scale = (Σ ŵ_m ‖v_m‖) / ‖u‖, or 0
    when u is rounding noise (`_U_NOISE`). Offers of norm <= eps count as zero (φ(0) = 0).
    Costs two read passes over the offers, one if `sq_norms` (‖v_m‖², None where unknown)
    are given. A single offer is its own RDA (‖v‖·φ(φ(v)) = v): then u is that offer itself.
    """
    d_hat = w_hat if d_hat is None else d_hat
    known = zip(leaves, sq_norms, strict=True)
    norms = np.sqrt([sq_norm(x, threads) if q is None else q for x, q in known])
    if len(leaves) == 1:
        return leaves[0], (1.0 if norms[0] > eps else 0.0)
    radius = float(np.dot(w_hat, norms))
    live = norms > eps
    a = np.where(live, d_hat / np.where(live, norms, 1.0), 0.0)
    out = None if scratch is None else scratch.array(np.shape(leaves[0]))
    u, u_sq_norm = weighted_sum(leaves, a, threads, out)
    u_norm = np.sqrt(u_sq_norm)
    noise = _U_NOISE * (len(leaves) + 3) * float(np.sum(d_hat[live]))
    return u, (radius / u_norm if u_norm > noise else 0.0)


def merge_rda(
    vs: list[dict],
    w: np.ndarray,
    eps: float = 1e-12,
    *,
    sq_norms: list[dict] | None = None,
    direction: np.ndarray | None = None,
) -> dict:
    """Radial-directional averaging per leaf, float32.

    Δ = (Σ w‖v‖ / Σw) · φ(Σ d φ(v) / Σd), φ(x) = x / ‖x‖, φ(0) = 0, with direction weights
    d = w unless `direction` gives them (`direction_weights`). The norm of Δ is the
    weighted mean norm of the offers however many are merged (unless their directions
    cancel to within float32 rounding, `_U_NOISE`: then Δ = 0); plain averaging would shrink
    it for diverse directions. Offers of norm <= `eps` count as zero. `sq_norms[m]` =
    `offer_sq_norms(vs[m])`, if already known, saves a pass.
    """
    vs, w_hat, norms, d_hat = _contributors_with(vs, w, sq_norms, direction)
    out = {}
    for k in vs[0]:
        known = [None if n is None else n[k] for n in norms]
        u, scale = _rda_direction([v[k] for v in vs], w_hat, eps, known, d_hat=d_hat)
        owned = len(vs) > 1  # else u is the caller's offer: never overwrite it
        out[k] = np.multiply(u, _F32(scale), out=u if owned else None, dtype=_F32)
    return out


def merge(vs: list[dict], w: np.ndarray, rule: str, direction: np.ndarray | None = None) -> dict:
    """Merged outer gradient Δ of offers `vs` with weights `w` by `rule` ("rda" | "mean");
    `direction`: RDA's direction weights (`merge_rda`)."""
    if rule not in RULES:
        raise ValueError(f"diloco.merge={rule!r}; expected one of {RULES}")
    return merge_rda(vs, w, direction=direction) if rule == "rda" else merge_mean(vs, w)


OuterState = outer.OuterState  # re-exported: the syncer's per-fragment optimizer state


def merge_outer_step(
    theta: dict,
    vs: list[dict],
    w: np.ndarray,
    rule: str,
    state: outer.OuterState,
    lr: float,
    momentum: float,
    nesterov: bool = True,
    *,
    scale: float = 1.0,
    work: float = 1.0,
    clock: str = "merge",
    inplace: bool = False,
    eps: float = 1e-12,
    sq_norms: list[dict] | None = None,
    return_delta_norm: bool = False,
    threads: int | None = 1,
    scratch: Scratch | None = None,
    theta_copy: dict | None = None,
    direction: np.ndarray | None = None,
) -> tuple[dict, outer.OuterState] | tuple[dict, outer.OuterState, float]:
    """`outer.outer_step(theta, scale · merge(vs, w, rule, direction), state, lr, momentum,
    nesterov, work=work, clock=clock)`, fused.

    The same bits with scale = 1 (float32 rounding apart otherwise: module docstring), but
    Δ is formed chunk by chunk inside the outer step instead of as a fragment-sized array
    (RDA still materialises its direction u, since ‖u‖ is needed before the first chunk can
    be scaled). With `inplace=True` (the syncer owns Θ and the momentum) nothing
    fragment-sized is allocated for "mean".
    `scale` and `work` come from `weigh`; `sq_norms` as in `merge_rda`. With
    `return_delta_norm`, also returns ‖Δ‖ (Δ including `scale`) over all leaves. `threads`:
    how many threads split each leaf's chunks (None/0: the host's cores; the result is the
    same for any count). `scratch`: where RDA puts u (reused memory: no page faults on
    the merge's critical path; see `chunks.Scratch`), else a new array per leaf.
    `theta_copy` {leaf: writable C-contiguous float32 array of its size}: also receives the
    new Θ, chunk by chunk while in cache (the syncer's reply, `reply_buffers.py`). Every
    leaf's buffers are checked before any leaf steps.
    """
    if rule not in RULES:
        raise ValueError(f"diloco.merge={rule!r}; expected one of {RULES}")
    if not np.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be finite and >= 0, got {scale}")
    vs, w_hat, norms, d_hat = _contributors_with(vs, w, sq_norms, direction)
    check_same_leaves([theta, vs[0]])
    if theta_copy is not None:  # all checked before any leaf steps
        _check_theta_copy(theta, theta_copy)
    decay, look = outer.momentum_terms(momentum, work, clock)
    bufs, theta_out, bufs_out = outer.outputs(theta, state, inplace)
    delta_sq_norm = 0.0
    for k in theta:
        leaf, leaves = (theta[k], bufs[k], theta_out[k], bufs_out[k]), [v[k] for v in vs]
        also = dict(threads=threads, copy_out=None if theta_copy is None else theta_copy[k])
        if rule == "mean":
            coefs = w_hat if scale == 1 else w_hat * scale
            delta_sq_norm += outer.apply_outer(
                leaf, leaves, coefs, lr, decay, look, nesterov, **also
            )
        else:  # one leaf's direction u at a time bounds the extra memory
            known = [None if n is None else n[k] for n in norms]
            u, s = _rda_direction(leaves, w_hat, eps, known, threads, scratch, d_hat)
            delta_sq_norm += outer.apply_outer(
                leaf, [u], [s * scale], lr, decay, look, nesterov, **also
            )
    out = theta_out, (state if inplace else outer.OuterState(bufs_out))
    return (*out, float(np.sqrt(delta_sq_norm))) if return_delta_norm else out


def _check_theta_copy(theta: dict, theta_copy: dict) -> None:
    if set(theta_copy) != set(theta):
        raise ValueError(f"theta_copy leaves differ: {sorted(set(theta_copy) ^ set(theta))[:5]}")
    for k, x in theta_copy.items():
        ok = isinstance(x, np.ndarray) and x.dtype == _F32 and x.flags.c_contiguous
        if not (ok and x.flags.writeable and x.size == np.size(theta[k])):
            raise ValueError(f"theta_copy[{k!r}] must be writable C-contiguous float32 of "
                             f"{np.size(theta[k])} values, got {getattr(x, 'dtype', type(x))} "
                             f"{np.shape(x)}")  # fmt: skip


ROUTER_SUFFIX = "moe/router"  # MoE router leaves: "block_<i>/moe/router" [D, E]


def router_divergence(vs: list[dict], w, theta: dict, eps: float = 1e-12) -> float | None:
    """How far apart the learners' routers moved: mean over router leaves of a fragment.

    Per router leaf (name ending in `ROUTER_SUFFIX`), with ŵ = w / Σw over offers with
    w > 0 and v̄ = Σ ŵ_m v_m their weighted mean outer gradient:
        sqrt(Σ_m ŵ_m ‖v_m − v̄‖²) / (‖Θ‖ + eps)
    the weighted standard deviation of the offers around their mean, relative to the
    global router Θ the merge starts from (dimensionless; 0 iff all offers agree). None
    when the fragment has no router leaf or fewer than two offers have weight > 0.
    Router leaves are tiny ([D, E]), so this is computed exactly in float64.
    """
    w = np.asarray(w, np.float64)
    keep = np.flatnonzero(w > 0)
    names = [k for k in theta if k.endswith(ROUTER_SUFFIX)]
    if len(keep) < 2 or not names:
        return None
    w_hat = w[keep] / w[keep].sum()
    spreads = []
    for k in names:
        offers = np.stack([np.asarray(vs[i][k], np.float64).reshape(-1) for i in keep])
        mean = w_hat @ offers
        spread = np.sqrt(w_hat @ np.sum((offers - mean) ** 2, axis=1))
        spreads.append(spread / (np.linalg.norm(np.asarray(theta[k], np.float64)) + eps))
    return float(np.mean(spreads))
