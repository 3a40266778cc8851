"""The DiLoCo protocol's device operations on a fragment's leaves (dicts of arrays), jitted
once per process, and the clock of their launches (`dispatch_waited`).

Shared by every replica of the process (`train/replica.py`), so learners on the same
devices compile each fragment's once; `Replica.precompile` compiles them before the first
step. Merges update θ in place: a donated leaf's buffer holds the result (no fragment-sized
allocation per merge, no second copy of it at the peak). Nothing else holds those buffers:
the train step donates the whole state every step, offers and snapshots are copies
(`Replica.fragment_copies`), saves are synchronous, and only data-parallel runs (which never
merge) evaluate the replica's own parameters.
"""

import threading
import time

import jax

# Seconds each thread has spent off the CPU inside the jitted calls below (`dispatch_waited`).
_dispatch_waits = threading.local()


def dispatch_waited() -> float:
    """Seconds the calling thread has spent off the CPU inside the jitted calls of `launch`,
    all told. A launch returns at once while the device has room for it, and blocks while
    its queue of programs is full (XLA:CPU holds 32 per device): a learner that far ahead
    waits for the device there, not in a metrics read, and that wait is not host work.
    (It also holds whatever else kept a launching thread off the CPU: a compile on other
    threads at a first call, the interpreter lock taken back after it.)"""
    return getattr(_dispatch_waits, "seconds", 0.0)


class Launch:
    """A jitted function whose calls add their off-CPU time to `dispatch_waited`; its other
    attributes (`lower`) are the function's."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        out = self._fn(*args, **kwargs)
        off = (time.perf_counter() - t) - (time.thread_time() - c)
        if off > 0:
            _dispatch_waits.seconds = dispatch_waited() + off
        return out

    def __getattr__(self, name):
        return getattr(self._fn, name)


def launch(*args, **kwargs) -> Launch:
    """`jax.jit(*args, **kwargs)`, timed as `Launch`."""
    return Launch(jax.jit(*args, **kwargs))


mix = launch(  # α·a + (1 − α)·b
    lambda a, b, alpha: jax.tree.map(lambda x, y: alpha * x + (1 - alpha) * y, a, b),
    donate_argnums=0,
)
add = launch(  # a + s·d
    lambda a, d, s: jax.tree.map(lambda x, y: x + s * y, a, d), donate_argnums=0
)
copy_leaves = launch(lambda a: jax.tree.map(lambda x: x.copy(), a))
# θ + R of members a landing set steps aside from (`Replica.land`): new arrays, one launch.
plus = launch(lambda theta, held: jax.tree.map(lambda t, r: t + r, theta, held))
# A landing's steps set aside (`Replica.land`): s·(θ + x − Θ_new), s = 1 − α, added onto the
# members' earlier R (donated) or new; x is used once.
set_aside = launch(
    lambda theta, x, new, s: jax.tree.map(lambda t, d, n: s * ((t + d) - n), theta, x, new),
    donate_argnums=1,
)
set_aside_onto = launch(
    lambda held, theta, x, new, s: jax.tree.map(
        lambda r, t, d, n: r + s * ((t + d) - n), held, theta, x, new
    ),
    donate_argnums=0,
)
# A rebase's x = Θ_new − G + v̂ (`diloco.updates.rebase_delta`, the same float32 operations
# in the same order: the same bits, except that XLA may flush subnormals, |x| < 1.2e-38, to
# zero where numpy keeps them), from arrays on the devices (`MergeStager`). Θ_new is not
# donated: it stays as the next rebase's G. v̂ is used once.
rebase_held = launch(
    lambda new, anchor, sent: jax.tree.map(lambda t, a, v: (t - a) + v, new, anchor, sent),
    donate_argnums=2,
)
rebase_shift = launch(lambda new, anchor: jax.tree.map(lambda t, a: t - a, new, anchor))
# An offer's outer gradient v = G − θ (`diloco.learner.materialize`'s float32 subtraction),
# from the G a `MergeStager` kept on the devices; a new array, so it survives donation.
outer = launch(lambda anchor, theta: jax.tree.map(lambda a, t: a - t, anchor, theta))
# The same from θ + R where a landing set steps aside: G − (θ + R), `plus` then `outer`'s
# float32 operations in one launch.
outer_plus = launch(
    lambda anchor, theta, held: jax.tree.map(lambda a, t, r: a - (t + r), anchor, theta, held)
)


def leaf_update(kind: str, alpha: float):
    """(jitted op, its scalar) that `Replica.apply` runs on whole leaves for an update of
    `kind` mixed with `alpha`; None where the update simply replaces them (a mix, α = 0)."""
    if kind == "add":
        return add, 1.0 - alpha
    if kind == "land":  # even at α = 0: θ must not become Θ_new's buffers (a stager keeps
        return mix, alpha  # them as the next G, and the train step donates θ)
    return (mix, alpha) if alpha else None
