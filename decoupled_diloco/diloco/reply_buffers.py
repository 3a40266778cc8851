"""Reply payloads that reuse memory no receiver holds any more.

Every merge sends its fragment's new Θ to the learners, uncompressed by default: a copy,
since the next merge updates Θ in place while receivers may still read this one. Copied
into a fresh fragment-sized array, every page faults on its first write (the kernel maps
and zeroes it). On the 2-core dev box that made the reply's copy of a 16 MiB fragment take
6-7 ms instead of ~1 ms, and the syncer's whole RDA merge at K = 4 offers twice as slow
(`scripts/bench_syncer_merge.py`, "syncer" rows). So the syncer watches each fragment's
recent replies and writes the next Θ into one nobody references any more.

"Nobody": CPython reference counts. Whoever reads a reply holds it through the message,
the `Encoded`, or numpy views of its arrays (a view references the array that owns the
memory, and so does a jax host-to-device transfer until it completes). When the only
references left are the pool's own, overwriting the memory cannot change anything anyone
can read. The count a lone reference gives is measured at import, not assumed (it differs
between interpreter versions). Anything unsure means "held": a fresh array, as before; a
free-threaded interpreter (no GIL) never reuses.

The cost is memory: each fragment keeps up to `diloco.reply_spares` (default 1) replies no
one holds, so the syncer's host holds up to that many more copies of Θ than it did
(0 turns reuse off). Free replies beyond that are dropped at each merge.

The syncer writes Θ into the reply inside the outer step (`merge_outer_step(...,
theta_copy=...)`), while each chunk is still in cache: one read pass of Θ fewer than a
separate copy. Compressed replies (bf16, intN) are new, smaller arrays per merge and are
not pooled.
"""

from __future__ import annotations

import math
import sys
import sysconfig

import numpy as np

from decoupled_diloco.diloco import compression

TRACKED = 3  # held replies watched per fragment (in process, learners hold ~2 versions)
# Reference counts say who holds an object only when the GIL serialises their changes.
_REFCOUNTS_OK = not sysconfig.get_config_var("Py_GIL_DISABLED")


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
    """Per fragment: the replies sent lately, watched until no one holds them; of those, at
    most `spares` are kept for the next merges to write into (`diloco.reply_spares`)."""

    def __init__(self, spares: int = 1):
        if spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.spares = spares if _REFCOUNTS_OK else 0
        self._pool: dict[int, list[compression.Encoded]] = {}
        self.reused = self.fresh = 0  # replies of each kind, for tests and benchmarks

    def take(self, p: int, like: dict) -> tuple[compression.Encoded, dict[str, np.ndarray]]:
        """(reply, its flat float32 arrays by leaf) for fragment `p` with leaves shaped like
        `like`: a spare no one holds, else new memory. The caller fills every array (e.g.
        `merge.merge_outer_step(..., theta_copy=...)`) before sending the reply."""
        pool = self._pool.setdefault(p, [])
        free = [i for i in range(len(pool)) if _unreferenced(pool, i)]
        match = next((i for i in free if _fits(pool[i], like)), None)
        if match is None:
            enc = _new_reply(like)
            self.fresh += 1
        else:
            enc = pool[match]
            free.remove(match)
            self.reused += 1
        # Free replies beyond the allowance leave (oldest first): their memory goes back to
        # the host; the rest are watched until they are free or too old to matter.
        gone = set(free[: max(len(free) - self.spares, 0)]) | {match}
        kept = [e for i, e in enumerate(pool) if i not in gone]
        pool[:] = kept[-(TRACKED + self.spares) :] + [enc] if self.spares else []
        return enc, {name: t[1] for name, t in enc.tensors.items()}


def _new_reply(like: dict) -> compression.Encoded:
    no_scales = np.zeros(0, np.float32)
    shapes = {name: tuple(int(d) for d in np.shape(x)) for name, x in like.items()}
    return compression.Encoded(
        "none",
        {name: (shape, np.empty(math.prod(shape), np.float32), no_scales)
         for name, shape in shapes.items()},
    )  # fmt: skip
