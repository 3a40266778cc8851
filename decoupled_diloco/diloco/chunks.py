"""Chunked float32 loops for the syncer's memory-bound math (merge rules, outer step).

Every element-wise loop walks its tensors in cache-sized chunks: the few float32
temporaries of one chunk stay in cache and each input is streamed from memory once per
pass. Reductions (norms) accumulate per chunk in float64.
"""

import numpy as np

CHUNK = 1 << 16  # elements per chunk: 256 KiB of float32; a chunk's working set fits in L2
F32 = np.float32


def slices(n: int):
    """Chunk slices of a flat length-n array (CHUNK is read at call time: tests shrink it)."""
    return (slice(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK))


def flat(x) -> np.ndarray:
    return np.asarray(x).reshape(-1)


def sq_norm(x) -> float:
    """‖x‖² with float32 dots per chunk summed in float64 (long float32 sums drift)."""
    x = flat(x)
    return float(sum(float(np.dot(x[s], x[s])) for s in slices(x.size)))


def combine(xs: list, coefs, s: slice, out: np.ndarray, tmp: np.ndarray, view_ok=False):
    """out = Σ coefs[m] · xs[m][s] (flat float32; `tmp` is scratch of out's length).

    With `view_ok`, a lone float32 term with coefficient 1 is returned as is (a view).
    """
    if view_ok and len(xs) == 1 and coefs[0] == 1 and xs[0].dtype == F32:
        return xs[0][s]
    np.multiply(xs[0][s], F32(coefs[0]), out=out)
    for x, c in zip(xs[1:], coefs[1:], strict=True):
        np.multiply(x[s], F32(c), out=tmp)
        np.add(out, tmp, out=out)
    return out


def weighted_sum(leaves: list, coefs) -> tuple[np.ndarray, float]:
    """(Σ coefs[m] · leaves[m] as a new float32 array, its squared norm), one pass."""
    out = np.empty(np.shape(leaves[0]), F32)
    out_flat, xs = out.reshape(-1), [flat(x) for x in leaves]
    tmp, sq = np.empty(min(out.size, CHUNK), F32), 0.0
    for s in slices(out.size):
        chunk = combine(xs, coefs, s, out_flat[s], tmp[: s.stop - s.start])
        sq += float(np.dot(chunk, chunk))
    return out, sq


def check_same_leaves(trees: list[dict]) -> None:
    first = trees[0]
    for tree in trees[1:]:
        if set(tree) != set(first):
            raise ValueError(f"leaf names differ: {sorted(set(tree) ^ set(first))[:5]}")
        for k, v in tree.items():
            if np.shape(v) != np.shape(first[k]):
                raise ValueError(f"{k}: shape {np.shape(v)} != {np.shape(first[k])}")
