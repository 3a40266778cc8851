"""Where an offer's time goes on its way to the syncer: wraps the outbox, the in-process link
and `Syncer.handle`, runs `scripts/bench_accelerator.py` with the given flags, and prints
the mean / median / p90 of each stage at exit. Run from the checkout's root:

    python experiments/results/merge_gil/trace_offer_path.py --part=fleet \
        --emulate_step_ms=10.4 --dtype=float32 --steps=200
"""

import atexit
import runpy
import statistics
import sys
import time

from decoupled_diloco.diloco import syncer
from decoupled_diloco.diloco.messages import Offer
from decoupled_diloco.runtime import links, outbox

STAGES = ("outbox_wait", "outbox_dur", "link_to_inbox", "inbox_wait", "handle")
seconds: dict[str, list[float]] = {k: [] for k in STAGES}
since: dict[tuple, float] = {}  # (stage, id(object)) -> when it entered the next stage


def wrap(cls, name, before=None, after=None):
    inner = getattr(cls, name)

    def wrapped(self, *args, **kw):
        t0 = time.perf_counter()
        if before:
            before(t0, *args)
        out = inner(self, *args, **kw)
        if after:
            after(t0, time.perf_counter(), out, *args)
        return out

    setattr(cls, name, wrapped)


def queued(t0, ticket, copies):  # Outbox.offer: the learner hands an offer over
    since["outbox", id(ticket)] = t0


def made_start(t0, ticket, copies):
    seconds["outbox_wait"].append(t0 - since.pop(("outbox", id(ticket)), t0))


def made(t0, t1, msg, ticket, copies):  # Outbox._make: bytes to host, v, encoding
    seconds["outbox_dur"].append(t1 - t0)
    since["link", id(msg)] = t1


def delivered(t0, dest, msg, nbytes):  # the link puts it into the syncer's inbox
    if isinstance(msg, Offer):
        seconds["link_to_inbox"].append(t0 - since.pop(("link", id(msg)), t0))
        since["inbox", id(msg)] = t0


def handling(t0, msg, now):
    if isinstance(msg, Offer):
        seconds["inbox_wait"].append(t0 - since.pop(("inbox", id(msg)), t0))


def handled(t0, t1, out, msg, now):
    seconds["handle"].append(t1 - t0)


wrap(outbox.Outbox, "offer", before=queued)
wrap(outbox.Outbox, "_make", before=made_start, after=made)
wrap(links.LocalLearnerLink, "_deliver", before=delivered)
wrap(syncer.Syncer, "handle", before=handling, after=handled)


@atexit.register
def report():
    for k, v in seconds.items():
        if v:
            mean, median = 1e3 * statistics.mean(v), 1e3 * statistics.median(v)
            p90 = 1e3 * sorted(v)[int(0.9 * len(v))]
            print(f"TRACE {k}: mean {mean:.1f} ms, median {median:.1f} ms, p90 {p90:.1f} ms")


sys.argv = ["bench_accelerator.py"] + sys.argv[1:]
runpy.run_path("scripts/bench_accelerator.py", run_name="__main__")
