"""Chunked float32 loops for the syncer's memory-bound math (merge rules, outer step).

Every element-wise loop walks its tensors in cache-sized chunks: the few float32
temporaries of one chunk stay in cache and each input is streamed from memory once per
pass. Reductions (norms) accumulate per chunk in float64.

A leaf of several chunks is split into contiguous spans of chunks that run on a shared
thread pool (`threads` workers; numpy releases the GIL inside each operation), so one
syncer host merges with all its cores. Every chunk does the same float32 operations
whichever thread runs it, and per-chunk reductions are added up in chunk order: the result
is bit-identical for any number of threads.
"""

import concurrent.futures
import os
import threading

import numpy as np

CHUNK = 1 << 16  # elements per chunk: 256 KiB of float32; a chunk's working set fits in L2
F32 = np.float32
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def host_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_threads(threads: int | None) -> int:
    """`diloco.merge_threads` semantics: None or 0 = the host's cores, else as given."""
    return host_cores() if not threads else int(threads)


def _executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="merge")
        return _pool


def map_spans(fn, n: int, threads: int | None = None) -> list:
    """Runs `fn(start, stop)` over contiguous chunk-aligned spans covering [0, n), on up to
    `threads` threads (None/0: the host's cores); returns the concatenation, in span order,
    of the lists `fn` returns (one entry per chunk, as `slices` would visit them)."""
    chunks = -(-n // CHUNK)
    parts = min(resolve_threads(threads), chunks)
    if parts <= 1:
        return fn(0, n)
    bounds = [min(n, (chunks * i // parts) * CHUNK) for i in range(parts + 1)]
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    futures = [_executor(parts).submit(fn, a, b) for a, b in spans]
    return [r for f in futures for r in f.result()]


def slices(n: int, start: int = 0):
    """Chunk slices of a flat length-n array from `start` (a chunk boundary; CHUNK is read
    at call time: tests shrink it)."""
    return (slice(s, min(s + CHUNK, n)) for s in range(start, n, CHUNK))


def flat(x) -> np.ndarray:
    return np.asarray(x).reshape(-1)


def sq_norm(x, threads: int | None = 1) -> float:
    """‖x‖² with float32 dots per chunk summed in float64 (long float32 sums drift)."""
    x = flat(x)

    def span(a, b):
        return [float(np.dot(x[s], x[s])) for s in slices(b, a)]

    return float(sum(map_spans(span, x.size, threads)))


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


def weighted_sum(leaves: list, coefs, threads: int | None = 1) -> tuple[np.ndarray, float]:
    """(Σ coefs[m] · leaves[m] as a new float32 array, its squared norm), one pass."""
    out = np.empty(np.shape(leaves[0]), F32)
    out_flat, xs = out.reshape(-1), [flat(x) for x in leaves]

    def span(a, b):
        tmp, sqs = np.empty(min(b - a, CHUNK), F32), []
        for s in slices(b, a):
            chunk = combine(xs, coefs, s, out_flat[s], tmp[: s.stop - s.start])
            sqs.append(float(np.dot(chunk, chunk)))
        return sqs

    sq = 0.0
    for x in map_spans(span, out.size, threads):
        sq += x
    return out, sq


def check_same_leaves(trees: list[dict]) -> None:
    first = trees[0]
    for tree in trees[1:]:
        if set(tree) != set(first):
            raise ValueError(f"leaf names differ: {sorted(set(tree) ^ set(first))[:5]}")
        for k, v in tree.items():
            if np.shape(v) != np.shape(first[k]):
                raise ValueError(f"{k}: shape {np.shape(v)} != {np.shape(first[k])}")
