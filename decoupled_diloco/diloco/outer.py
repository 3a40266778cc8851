"""The outer optimizer: SGD with (Nesterov) momentum on merged outer gradients, float32.

DiLoCo's outer step, once per round of all M learners: buf ← μ·buf + Δ, Θ ← Θ − lr·(Δ + μ·buf)
(Nesterov) or Θ ← Θ − lr·(Δ + μ·buf_old) (heavy ball, = Θ − lr·buf).

Decoupled merges are not rounds: a merge may hold a few learners' work (K < M), or late
work of earlier slots. Applied once per merge, momentum then amplifies each partial merge as
if it were a full round, and momentum's memory (1/(1−μ) merges) shrinks as merges get
smaller; Async Local-SGD (Liu et al. 2024, arXiv 2401.09135) found momentum on
asynchronous pseudo-gradients to be the main loss and delayed the momentum update to
every N-th arrival ("Delayed Nesterov"). We clock momentum by work instead of arrivals
(`clock="work"`): a merge that carries the share c of one full round of the live
learners' work (c from `merge.weigh`, summed over its offers) advances momentum by c steps:

    buf ← μ^c·buf + Δ;   Θ ← Θ − lr·(Δ + λ(c)·buf),   λ(c) = μ·(1 − μ^c)/(1 − μ)
                                                       (Nesterov; heavy ball: buf_old)

A full round (c = 1, λ = μ) is exactly DiLoCo's step. λ(c) is the look that makes merges
whose work adds up to one round move Θ by exactly DiLoCo's steady-state step lr·Δ/(1 − μ)
per round, however the work was split: with n merges of c = 1/n the buffer settles at
Δ_c/(1 − μ^c), and n·lr·(Δ_c + λ·Δ_c/(1 − μ^c)) = lr·Δ·(1 + μ/(1 − μ)). (The linear look
c·μ, used before, made partial merges step less than full rounds: 7% less per round at
μ = 0.5 with two merges a round, 14% with many; 2-5% at μ = 0.9.) Momentum remembers
1/(1−μ) rounds of work. `clock="merge"` is the classic one step per merge (c = 1 always).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from decoupled_diloco.diloco import chunks
from decoupled_diloco.diloco.chunks import F32, check_same_leaves, combine, flat

CLOCKS = ("work", "merge")


@dataclasses.dataclass
class OuterState:
    """Outer optimizer state of one fragment."""

    momentum: dict[str, np.ndarray]  # per-leaf float32 momentum buffer, starts at zeros

    @classmethod
    def zeros(cls, theta: dict) -> OuterState:
        return cls({k: np.zeros(np.shape(v), F32) for k, v in theta.items()})


def momentum_terms(momentum: float, work: float = 1.0, clock: str = "merge") -> tuple[float, float]:
    """(decay, look): buf ← decay·buf + Δ and Θ ← Θ − lr·(Δ + look·buf) for a merge
    carrying `work` rounds of work (module docstring)."""
    if clock not in CLOCKS:
        raise ValueError(f"diloco.momentum_clock={clock!r}; expected one of {CLOCKS}")
    if clock == "merge":
        return momentum, momentum
    if not np.isfinite(work) or work < 0:
        raise ValueError(f"work must be finite and >= 0, got {work}")
    decay = float(momentum**work)
    # (1 − μ^c)/(1 − μ) first: exactly 1 for c = 1, so a full round is DiLoCo's step bit for bit
    return decay, float(momentum * ((1.0 - decay) / (1.0 - momentum)))


def outputs(theta: dict, state: OuterState, inplace: bool) -> tuple[dict, dict, dict]:
    """(momentum in, Θ out, momentum out): the inputs themselves if `inplace`, else new.

    Checks every leaf before any is written: a step that failed half-way through would
    leave Θ part stepped, part not.
    """
    extra = set(state.momentum) - set(theta)
    if extra:
        raise ValueError(f"outer state has leaves not in the fragment: {sorted(extra)[:5]}")
    for k, buf in state.momentum.items():  # (numpy would broadcast or cut a wrong one)
        if np.shape(buf) != np.shape(theta[k]):
            raise ValueError(f"momentum[{k!r}]: shape {np.shape(buf)} != Θ's {np.shape(theta[k])}")
    bufs = {
        k: state.momentum[k] if k in state.momentum else np.zeros(np.shape(v), F32)
        for k, v in theta.items()
    }
    if not inplace:
        new = lambda: {k: np.empty(np.shape(v), F32) for k, v in theta.items()}
        return bufs, new(), new()
    for k in theta:
        for name, x in (("theta", theta[k]), ("momentum", bufs[k])):
            ok = isinstance(x, np.ndarray) and x.dtype == F32 and x.flags.c_contiguous
            if not (ok and x.flags.writeable):
                raise ValueError(f"inplace: {name}[{k!r}] must be writable C-contiguous float32")
    state.momentum.update(bufs)
    return bufs, theta, bufs


def apply_outer(leaf: tuple, xs: list, coefs, lr, decay, look, nesterov: bool,
                threads: int | None = None, copy_out=None) -> float:  # fmt: skip
    """Outer step of one leaf with Δ = Σ_m coefs[m] · xs[m], formed chunk by chunk; ‖Δ‖².

    leaf = (Θ, buf, Θ out, buf out), outputs possibly aliasing inputs. ‖Δ‖² comes almost
    free: each chunk of Δ is still in cache when it is dotted with itself. Spans of chunks
    run on up to `threads` threads (`chunks.map_spans`; same result for any count).
    `copy_out` (optional, Θ's size): also gets the new Θ, each chunk copied while in cache.
    """
    th, b, th_out, b_out = (flat(x) for x in leaf)
    also = None if copy_out is None else flat(copy_out)
    if also is not None and also.size != th.size:
        raise ValueError(f"copy_out has {also.size} values for a leaf of {th.size}")
    xs, lr, decay, look = [flat(x) for x in xs], F32(lr), F32(decay), F32(look)
    # Momentum 0: Θ ← Θ − lr·Δ reads no buffer, and the buffer (Δ, the last merge's) would be
    # read by no later step while the momentum stays 0: it is left as it is, which saves a
    # merge two of its passes over memory (Θ is the same, bit for bit).
    plain = decay == 0 and look == 0
    if plain and b_out is not b:
        np.copyto(b_out, b)

    def span(start: int, stop: int) -> list[float]:
        n_buf = min(stop - start, chunks.CHUNK)
        delta_buf, tmp_buf = np.empty(n_buf, F32), np.empty(n_buf, F32)
        sqs = []
        for s in chunks.slices(stop, start):
            n = s.stop - s.start
            delta, tmp = combine(xs, coefs, s, delta_buf[:n], tmp_buf[:n], True), tmp_buf[:n]
            sqs.append(float(np.dot(delta, delta)))
            if plain:
                np.multiply(delta, lr, out=tmp)
                np.subtract(th[s], tmp, out=th_out[s])
                if also is not None:
                    np.copyto(also[s], th_out[s])
                continue
            if not nesterov:  # the step looks at the buffer before this Δ joins it
                np.multiply(b[s], look, out=tmp)
                np.add(tmp, delta, out=tmp)
            np.multiply(b[s], decay, out=b_out[s])
            np.add(b_out[s], delta, out=b_out[s])
            if nesterov:
                np.multiply(b_out[s], look, out=tmp)
                np.add(tmp, delta, out=tmp)
            np.multiply(tmp, lr, out=tmp)
            np.subtract(th[s], tmp, out=th_out[s])
            if also is not None:
                np.copyto(also[s], th_out[s])
        return sqs

    delta_sq_norm = 0.0
    for x in chunks.map_spans(span, th.size, threads):
        delta_sq_norm += x
    return delta_sq_norm


def outer_step(
    theta: dict,
    delta: dict,
    state: OuterState,
    lr: float,
    momentum: float,
    nesterov: bool = True,
    *,
    work: float = 1.0,
    clock: str = "merge",
    inplace: bool = False,
) -> tuple[dict, OuterState]:
    """One outer step with merged outer gradient Δ = `delta`: returns (new Θ, new state).

    `work`/`clock` as in the module docstring (the default is DiLoCo's step). Leaves missing
    from `state.momentum` start from zero. `inplace=True` overwrites `theta` and the
    momentum buffers (C-contiguous float32) instead of allocating new arrays.
    """
    check_same_leaves([theta, delta])
    decay, look = momentum_terms(momentum, work, clock)
    bufs, theta_out, bufs_out = outputs(theta, state, inplace)
    for k in theta:
        leaf = (theta[k], bufs[k], theta_out[k], bufs_out[k])
        apply_outer(leaf, [delta[k]], [1.0], lr, decay, look, nesterov)
    return theta_out, (state if inplace else OuterState(bufs_out))
