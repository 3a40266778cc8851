"""Reply payloads that reuse memory no receiver holds any more.

Every merge sends its fragment's new Θ to the learners, uncompressed by default: a copy,
since the next merge updates Θ in place while receivers may still read this one. Copied
into a fresh fragment-sized array, every page faults on its first write (the kernel maps
and zeroes it). On the 2-core dev box that made the reply's copy of a 16 MiB fragment take
6-7 ms instead of ~1 ms, and the syncer's whole RDA merge at K = 4 offers twice as slow
(`scripts/bench_syncer_merge.py`, "syncer" rows). So the syncer keeps each fragment's last
few replies and copies the next Θ into one nobody references any more.

"Nobody": CPython reference counts. Whoever reads a reply holds it through the message,
the `Encoded`, or numpy views of its arrays (a view references the array that owns the
memory, and so does a jax host-to-device transfer until it completes). When the only
references left are the pool's own, overwriting the memory cannot change anything anyone
can read. The count a lone reference gives is measured at import, not assumed (it differs
between interpreter versions). Anything unsure means "held": a fresh array, as before.

The syncer writes Θ into the reply inside the outer step (`merge_outer_step(...,
theta_copy=...)`), while each chunk is still in cache: one read pass of Θ fewer than a
separate copy. Compressed replies (bf16, intN) are new, smaller arrays per merge and are
not pooled.
"""

from __future__ import annotations

import sys

import numpy as np

from decoupled_diloco.diloco import compression

KEEP = 3  # replies pooled per fragment: in process, learners hold ~2 versions (τ ≥ 1)


def _alone() -> int:
    """sys.getrefcount of an object whose one reference is a container slot."""
    box = [object()]
    return sys.getrefcount(box[0])


_ALONE = _alone()


def _unreferenced(pool: list, i: int) -> bool:
    """Whether pool[i] (an Encoded, "none") and its arrays are referenced by the pool only."""
    if sys.getrefcount(pool[i]) != _ALONE or sys.getrefcount(pool[i].tensors) != _ALONE:
        return False
    tensors = pool[i].tensors
    for name in tensors:  # the tuple's slot 1 is the array's one reference when free
        if sys.getrefcount(tensors[name]) != _ALONE or sys.getrefcount(tensors[name][1]) != _ALONE:
            return False
    return True


def _fits(enc: compression.Encoded, like: dict) -> bool:
    return set(enc.tensors) == set(like) and all(
        enc.tensors[k][0] == tuple(int(d) for d in np.shape(like[k])) for k in like
    )


class ReplyBuffers:
    """Per fragment, the last `keep` uncompressed replies, reused once unreferenced."""

    def __init__(self, keep: int = KEEP):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._pool: dict[int, list[compression.Encoded]] = {}
        self.reused = self.fresh = 0  # replies of each kind, for tests and benchmarks

    def take(self, p: int, like: dict) -> tuple[compression.Encoded, dict[str, np.ndarray]]:
        """(reply, its flat float32 arrays by leaf) for fragment `p` with leaves shaped like
        `like`: a pooled reply no one holds, else new memory. The caller fills every array
        (e.g. `merge.merge_outer_step(..., theta_copy=...)`) before sending the reply."""
        pool = self._pool.setdefault(p, [])
        for i in range(len(pool)):
            if _unreferenced(pool, i) and _fits(pool[i], like):
                enc = pool.pop(i)
                self.reused += 1
                break
        else:
            no_scales = np.zeros(0, np.float32)
            enc = compression.Encoded(
                "none",
                {
                    name: (tuple(int(d) for d in np.shape(x)), np.empty(np.size(x), np.float32),
                           no_scales)
                    for name, x in like.items()
                },
            )  # fmt: skip
            self.fresh += 1
            if len(pool) >= self.keep:
                pool.pop(0)  # the oldest leaves the pool; its receivers keep it alive
        pool.append(enc)  # most recently sent last
        return enc, {name: t[1] for name, t in enc.tensors.items()}
