"""Chunked float32 loops for the syncer's memory-bound math (merge rules, outer step).

Every element-wise loop walks its tensors in cache-sized chunks: the few float32
temporaries of one chunk stay in cache and each input is streamed from memory once per
pass. Norms are float32 dots over rows of `ROW` values, summed in float64 (`sq_norm`).

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

# Elements per chunk: 1 MiB of float32, so a chunk's few temporaries stay in a server core's
# L2. Every numpy call on a chunk releases the interpreter lock and must take it back, and
# beside busy Python threads (a process's learners) each take waits for them: 4x fewer,
# larger calls than 64 Ki-element chunks merged a `mid` fragment 1.5-2x faster beside four
# such threads in three runs of four (one was 10% slower), and no slower alone (2026-11-26,
# experiments/results/merge_gil/).
CHUNK = 1 << 18
# Values per float32 dot in `sq_norm`. One float32 dot over a whole chunk was off by up to
# ~1e-6 relative (random data); rows of 4096 summed in float64 are good to ~1e-8 for a few
# µs more per chunk (dev box: 30 → 35-40 µs in cache, a pass over memory 0-20% slower).
# RDA needs that: its offers' norms decide when their directions cancel.
ROW = 4096
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
    """‖x‖² of x as float32: float32 dots over rows of `ROW` values, summed in float64.

    Other dtypes are cast to float32 a chunk at a time (a float16 dot overflows at 65504,
    a bfloat16 one keeps 8 bits). Overflows to inf where a row's ‖·‖² passes float32's
    largest value (~3.4e38: a value above ~1.8e19, or a row of RMS above ~2.9e17).
    """
    x = flat(x)

    def span(a, b):
        sqs = []
        for s in slices(b, a):
            c = x[s] if x.dtype == F32 else x[s].astype(F32)
            whole = c.size - c.size % ROW
            rows, rest = c[:whole].reshape(-1, ROW), c[whole:]
            row_sqs = rows[:, None, :] @ rows[:, :, None]  # (np.vecdot needs numpy 2)
            sqs.append(float(row_sqs.sum(dtype=np.float64)) + float(rest @ rest))
        return sqs

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


def weighted_sum(
    leaves: list, coefs, threads: int | None = 1, out: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """(Σ coefs[m] · leaves[m] as a float32 array, its squared norm), one pass.

    The sum goes into `out` if given (C-contiguous float32 of the leaves' shape, e.g. a
    `Scratch` view), else into a new array.
    """
    if out is None:
        out = np.empty(np.shape(leaves[0]), F32)
    elif out.shape != np.shape(leaves[0]) or out.dtype != F32 or not out.flags.c_contiguous:
        raise ValueError(f"out: {out.dtype}{out.shape} for {np.shape(leaves[0])} leaves")
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


def copy(src, dst: np.ndarray, threads: int | None = 1) -> None:
    """dst[...] = src (same size, dst C-contiguous), spans of chunks on up to `threads`."""
    src, out = flat(src), dst.reshape(-1)
    if src.size != out.size:
        raise ValueError(f"copy of {src.size} values into {out.size}")

    def span(a, b):
        np.copyto(out[a:b], src[a:b])
        return []

    map_spans(span, src.size, threads)


class Scratch:
    """One float32 buffer reused for fragment-sized temporaries, grown to the largest size
    asked for. A fresh fragment-sized array costs a page fault per page on its first write
    (the kernel maps and zeroes it): on the dev box that made writing 16 MiB into new
    memory 4-6x slower than into memory already touched. Not thread-safe: one owner at a
    time (the syncer, which merges under its lock)."""

    def __init__(self):
        self._buf = np.empty(0, F32)

    def array(self, shape) -> np.ndarray:
        """A C-contiguous float32 view of `shape` into the buffer (valid until the next call)."""
        n = int(np.prod(shape, dtype=np.int64))
        if self._buf.size < n:
            self._buf = np.empty(n, F32)
        return self._buf[:n].reshape(shape)


def check_same_leaves(trees: list[dict]) -> None:
    first = trees[0]
    for tree in trees[1:]:
        if set(tree) != set(first):
            raise ValueError(f"leaf names differ: {sorted(set(tree) ^ set(first))[:5]}")
        for k, v in tree.items():
            if np.shape(v) != np.shape(first[k]):
                raise ValueError(f"{k}: shape {np.shape(v)} != {np.shape(first[k])}")
