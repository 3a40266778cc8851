"""Syncer math: token weights, merge rules (mean, RDA), the outer Nesterov step, and the
divergence of the learners' MoE routers (a merge diagnostic).

Arrays are dicts {leaf name: np.ndarray}; all math is float32 except scalar reductions
(norms, weights), which accumulate in float64. Norms are per tensor (per leaf).

The syncer is memory-bandwidth bound, so every element-wise loop walks the tensors in
cache-sized chunks: the few float32 temporaries of one chunk stay in cache and each input
is streamed from memory once per pass. `merge_outer_step` computes exactly
`outer_step(theta, merge(vs, w, rule), ...)` (same float32 operations, so the same bits)
without materialising Δ, and in place if asked: the syncer's fast path.

Nothing here mutates its inputs unless called with `inplace=True`: the syncer may still
hold (or be sending, or checkpointing) the arrays it passes in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

WEIGHTINGS = ("tokens", "uniform")
RULES = ("rda", "mean")
_CHUNK = 1 << 16  # elements per chunk: 256 KiB of float32; a chunk's working set fits in L2
_F32 = np.float32


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


def outer_gradient(anchor: dict, local: dict) -> dict:
    """v = anchor − local per leaf, float32 (the DiLoCo outer gradient)."""
    _check_same_leaves([anchor, local])
    return {k: np.subtract(anchor[k], local[k], dtype=_F32) for k in anchor}


def _chunks(n: int):
    return (slice(s, min(s + _CHUNK, n)) for s in range(0, n, _CHUNK))


def _flat(x) -> np.ndarray:
    return np.asarray(x).reshape(-1)


def _sq_norm(x) -> float:
    """‖x‖² with float32 dots per chunk summed in float64 (long float32 sums drift)."""
    x = _flat(x)
    return float(sum(float(np.dot(x[s], x[s])) for s in _chunks(x.size)))


def offer_sq_norms(v: dict) -> dict[str, float]:
    """‖v_k‖² per leaf of one offer; non-finite if any value is (or the sum overflows).

    RDA needs these before it can merge. A syncer that computes them when an offer
    arrives (doubling as its finiteness check) and passes them as `sq_norms` takes one
    of RDA's two read passes over the offers off the merge's critical path.
    """
    return {k: _sq_norm(x) for k, x in v.items()}


def _combine(xs: list, coefs, s: slice, out: np.ndarray, tmp: np.ndarray, view_ok=False):
    """out = Σ coefs[m] · xs[m][s] (flat float32; `tmp` is scratch of out's length).

    With `view_ok`, a lone float32 term with coefficient 1 is returned as is (a view).
    """
    if view_ok and len(xs) == 1 and coefs[0] == 1 and xs[0].dtype == _F32:
        return xs[0][s]
    np.multiply(xs[0][s], _F32(coefs[0]), out=out)
    for x, c in zip(xs[1:], coefs[1:], strict=True):
        np.multiply(x[s], _F32(c), out=tmp)
        np.add(out, tmp, out=out)
    return out


def _weighted_sum(leaves: list, coefs) -> tuple[np.ndarray, float]:
    """(Σ coefs[m] · leaves[m] as a new float32 array, its squared norm), one pass."""
    out = np.empty(np.shape(leaves[0]), _F32)
    out_flat, xs = out.reshape(-1), [_flat(x) for x in leaves]
    tmp, sq_norm = np.empty(min(out.size, _CHUNK), _F32), 0.0
    for s in _chunks(out.size):
        chunk = _combine(xs, coefs, s, out_flat[s], tmp[: s.stop - s.start])
        sq_norm += float(np.dot(chunk, chunk))
    return out, sq_norm


def _check_same_leaves(trees: list[dict]) -> None:
    first = trees[0]
    for tree in trees[1:]:
        if set(tree) != set(first):
            raise ValueError(f"leaf names differ: {sorted(set(tree) ^ set(first))[:5]}")
        for k, v in tree.items():
            if np.shape(v) != np.shape(first[k]):
                raise ValueError(f"{k}: shape {np.shape(v)} != {np.shape(first[k])}")


def _contributors(vs: list[dict], w, sq_norms=None) -> tuple[list[dict], np.ndarray, list]:
    """Validates offers and weights; keeps offers with w > 0 and normalises w to sum 1.

    Returns (kept offers, their normalised weights, their `sq_norms` entries or Nones).
    """
    if not vs:
        raise ValueError("merge needs at least one offer")
    w = np.asarray(w, np.float64)
    if w.shape != (len(vs),):
        raise ValueError(f"weights shape {w.shape} != ({len(vs)},)")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be finite and >= 0, got {w}")
    if w.sum() <= 0:
        raise ValueError("no offer has a positive weight")
    _check_same_leaves(vs)
    if sq_norms is not None and len(sq_norms) != len(vs):
        raise ValueError(f"sq_norms has {len(sq_norms)} entries for {len(vs)} offers")
    keep = np.flatnonzero(w > 0)
    norms = [None if sq_norms is None else sq_norms[i] for i in keep]
    return [vs[i] for i in keep], w[keep] / w[keep].sum(), norms


def merge_mean(vs: list[dict], w: np.ndarray) -> dict:
    """Weighted mean Σ w_m v_m / Σ w_m per leaf, float32."""
    vs, w_hat, _ = _contributors(vs, w)
    return {k: _weighted_sum([v[k] for v in vs], w_hat)[0] for k in vs[0]}


def _rda_direction(leaves: list, w_hat, eps: float, sq_norms: list) -> tuple[np.ndarray, float]:
    """(u, scale) with RDA's Δ = scale · u for one leaf.

    u = Σ ŵ_m φ(v_m) is the weighted mean direction (a new float32 array) and scale =
    (Σ ŵ_m ‖v_m‖) / ‖u‖, or 0 when u vanishes (φ(0) = 0). Costs two read passes over the
    offers, one if `sq_norms` (‖v_m‖², None where unknown) are given. A single offer is
    its own RDA (‖v‖·φ(φ(v)) = v): then u is that offer itself.
    """
    norms = np.sqrt(
        [_sq_norm(x) if q is None else q for x, q in zip(leaves, sq_norms, strict=True)]
    )
    if len(leaves) == 1:
        return leaves[0], (1.0 if norms[0] > eps else 0.0)
    radius = float(np.dot(w_hat, norms))
    a = np.where(norms > eps, w_hat / np.where(norms > eps, norms, 1.0), 0.0)
    u, u_sq_norm = _weighted_sum(leaves, a)
    u_norm = np.sqrt(u_sq_norm)
    return u, (radius / u_norm if u_norm > eps else 0.0)


def merge_rda(
    vs: list[dict], w: np.ndarray, eps: float = 1e-12, *, sq_norms: list[dict] | None = None
) -> dict:
    """Radial-directional averaging per leaf, float32.

    Δ = (Σ w‖v‖ / Σw) · φ(Σ w φ(v) / Σw), φ(x) = x / ‖x‖, φ(0) = 0. The norm of Δ is the
    weighted mean norm of the offers however many are merged (unless their directions
    cancel exactly, then Δ = 0); plain averaging would shrink it for diverse directions.
    `sq_norms[m]` = `offer_sq_norms(vs[m])`, if already known, saves a pass.
    """
    vs, w_hat, norms = _contributors(vs, w, sq_norms)
    out = {}
    for k in vs[0]:
        known = [None if n is None else n[k] for n in norms]
        u, scale = _rda_direction([v[k] for v in vs], w_hat, eps, known)
        owned = len(vs) > 1  # else u is the caller's offer: never overwrite it
        out[k] = np.multiply(u, _F32(scale), out=u if owned else None, dtype=_F32)
    return out


def merge(vs: list[dict], w: np.ndarray, rule: str) -> dict:
    """Merged outer gradient Δ of offers `vs` with weights `w` by `rule` ("rda" | "mean")."""
    if rule not in RULES:
        raise ValueError(f"diloco.merge={rule!r}; expected one of {RULES}")
    return merge_rda(vs, w) if rule == "rda" else merge_mean(vs, w)


@dataclasses.dataclass
class OuterState:
    """Outer optimizer state of one fragment."""

    momentum: dict[str, np.ndarray]  # per-leaf float32 Nesterov buffer, starts at zeros

    @classmethod
    def zeros(cls, theta: dict) -> OuterState:
        return cls({k: np.zeros(np.shape(v), _F32) for k, v in theta.items()})


def _outputs(theta: dict, state: OuterState, inplace: bool) -> tuple[dict, dict, dict]:
    """(momentum in, Θ out, momentum out): the inputs themselves if `inplace`, else new."""
    extra = set(state.momentum) - set(theta)
    if extra:
        raise ValueError(f"outer state has leaves not in the fragment: {sorted(extra)[:5]}")
    bufs = {
        k: state.momentum[k] if k in state.momentum else np.zeros(np.shape(v), _F32)
        for k, v in theta.items()
    }
    if not inplace:
        new = lambda: {k: np.empty(np.shape(v), _F32) for k, v in theta.items()}
        return bufs, new(), new()
    for k in theta:
        for name, x in (("theta", theta[k]), ("momentum", bufs[k])):
            ok = isinstance(x, np.ndarray) and x.dtype == _F32 and x.flags.c_contiguous
            if not (ok and x.flags.writeable):
                raise ValueError(f"inplace: {name}[{k!r}] must be writable C-contiguous float32")
    state.momentum.update(bufs)
    return bufs, theta, bufs


def _apply_outer(leaf: tuple, xs: list, coefs, lr, momentum, nesterov: bool) -> float:
    """Outer step of one leaf with Δ = Σ_m coefs[m] · xs[m], formed chunk by chunk; ‖Δ‖².

    leaf = (Θ, buf, Θ out, buf out), outputs possibly aliasing inputs. Per chunk, float32:
    buf = μ·buf + Δ;  Θ = Θ − lr·(Δ + μ·buf) (Nesterov) or Θ − lr·buf. ‖Δ‖² comes almost
    free: each chunk of Δ is still in cache when it is dotted with itself.
    """
    th, b, th_out, b_out = (_flat(x) for x in leaf)
    xs, lr, mu = [_flat(x) for x in xs], _F32(lr), _F32(momentum)
    delta_buf, tmp_buf = np.empty(min(th.size, _CHUNK), _F32), np.empty(min(th.size, _CHUNK), _F32)
    delta_sq_norm = 0.0
    for s in _chunks(th.size):
        n = s.stop - s.start
        delta, tmp = _combine(xs, coefs, s, delta_buf[:n], tmp_buf[:n], True), tmp_buf[:n]
        delta_sq_norm += float(np.dot(delta, delta))
        np.multiply(b[s], mu, out=b_out[s])
        np.add(b_out[s], delta, out=b_out[s])
        if nesterov:
            np.multiply(b_out[s], mu, out=tmp)
            np.add(tmp, delta, out=tmp)
            np.multiply(tmp, lr, out=tmp)
        else:
            np.multiply(b_out[s], lr, out=tmp)
        np.subtract(th[s], tmp, out=th_out[s])
    return delta_sq_norm


def outer_step(
    theta: dict,
    delta: dict,
    state: OuterState,
    lr: float,
    momentum: float,
    nesterov: bool = True,
    *,
    inplace: bool = False,
) -> tuple[dict, OuterState]:
    """Outer SGD with (Nesterov) momentum in float32: returns (new Θ, new state).

    buf = μ·buf + Δ;  Θ = Θ − lr·(Δ + μ·buf) (Nesterov) or Θ − lr·buf. Leaves missing
    from `state.momentum` start from zero. `inplace=True` overwrites `theta` and the
    momentum buffers (C-contiguous float32) instead of allocating new arrays.
    """
    _check_same_leaves([theta, delta])
    bufs, theta_out, bufs_out = _outputs(theta, state, inplace)
    for k in theta:
        leaf = (theta[k], bufs[k], theta_out[k], bufs_out[k])
        _apply_outer(leaf, [delta[k]], [1.0], lr, momentum, nesterov)
    return theta_out, (state if inplace else OuterState(bufs_out))


def merge_outer_step(
    theta: dict,
    vs: list[dict],
    w: np.ndarray,
    rule: str,
    state: OuterState,
    lr: float,
    momentum: float,
    nesterov: bool = True,
    *,
    inplace: bool = False,
    eps: float = 1e-12,
    sq_norms: list[dict] | None = None,
    return_delta_norm: bool = False,
) -> tuple[dict, OuterState] | tuple[dict, OuterState, float]:
    """`outer_step(theta, merge(vs, w, rule), state, lr, momentum, nesterov)`, fused.

    Same float32 operations, so the same result, but Δ is formed chunk by chunk inside the
    outer step instead of as a fragment-sized array (RDA still materialises its direction
    u, since ‖u‖ is needed before the first chunk can be scaled). With `inplace=True`
    (the syncer owns Θ and the momentum) nothing fragment-sized is allocated for "mean".
    `sq_norms` as in `merge_rda`. With `return_delta_norm`, also returns ‖Δ‖, the L2 norm
    of the merged outer gradient over all leaves (what `merge` would have returned).
    """
    if rule not in RULES:
        raise ValueError(f"diloco.merge={rule!r}; expected one of {RULES}")
    vs, w_hat, norms = _contributors(vs, w, sq_norms)
    _check_same_leaves([theta, vs[0]])
    bufs, theta_out, bufs_out = _outputs(theta, state, inplace)
    delta_sq_norm = 0.0
    for k in theta:
        leaf, leaves = (theta[k], bufs[k], theta_out[k], bufs_out[k]), [v[k] for v in vs]
        if rule == "mean":
            delta_sq_norm += _apply_outer(leaf, leaves, w_hat, lr, momentum, nesterov)
        else:  # one leaf's direction u at a time bounds the extra memory
            known = [None if n is None else n[k] for n in norms]
            u, scale = _rda_direction(leaves, w_hat, eps, known)
            delta_sq_norm += _apply_outer(leaf, [u], [scale], lr, momentum, nesterov)
    out = theta_out, (state if inplace else OuterState(bufs_out))
    return (*out, float(np.sqrt(delta_sq_norm))) if return_delta_norm else out


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
