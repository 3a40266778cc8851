import sys, time, runpy, statistics as st, atexit, queue
from decoupled_diloco.runtime import outbox as ob, links as lk, syncer_loop as sl
from decoupled_diloco.diloco import syncer as sy
from decoupled_diloco.diloco.messages import Offer
rec = {"outbox_wait": [], "outbox_dur": [], "link_to_inbox": [], "inbox_wait": [], "handle": [], "batch": []}
stamp = {}
off = ob.Outbox.offer
def _offer(self, ticket, copies):
    stamp[("o", id(ticket))] = time.perf_counter(); return off(self, ticket, copies)
ob.Outbox.offer = _offer
make = ob.Outbox._make
def _make(self, ticket, copies):
    t0 = time.perf_counter()
    rec["outbox_wait"].append(t0 - stamp.pop(("o", id(ticket)), t0))
    out = make(self, ticket, copies)
    t1 = time.perf_counter(); rec["outbox_dur"].append(t1 - t0)
    stamp[("m", id(out))] = t1
    return out
ob.Outbox._make = _make
deliver = lk.LocalLearnerLink._deliver
def _deliver(self, dest, msg, nbytes):
    if isinstance(msg, Offer):
        t = time.perf_counter(); rec["link_to_inbox"].append(t - stamp.pop(("m", id(msg)), t)); stamp[("i", id(msg))] = t
    return deliver(self, dest, msg, nbytes)
lk.LocalLearnerLink._deliver = _deliver
handle = sy.Syncer.handle
def _handle(self, msg, now, **kw):
    t0 = time.perf_counter()
    if isinstance(msg, Offer):
        rec["inbox_wait"].append(t0 - stamp.pop(("i", id(msg)), t0))
    out = handle(self, msg, now, **kw)
    rec["handle"].append(time.perf_counter() - t0)
    return out
sy.Syncer.handle = _handle
def report():
    for k, v in rec.items():
        if v: print(f"TRACE {k}: mean {1e3*st.mean(v):.1f} ms, median {1e3*st.median(v):.1f} ms, p90 {1e3*sorted(v)[int(.9*len(v))]:.1f}, n {len(v)}, total {sum(v):.1f} s")
atexit.register(report)
sys.argv = ["bench_accelerator.py"] + sys.argv[1:]
runpy.run_path("scripts/bench_accelerator.py", run_name="__main__")
