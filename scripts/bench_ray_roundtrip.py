r"""Fragment round trips through the Ray runtime vs the local runtime (the transport alone).

    python scripts/bench_ray_roundtrip.py            # tiny + ~110M model, 10 rounds
    python scripts/bench_ray_roundtrip.py --quick    # 3 rounds

Part 1, the transport alone (no training). One learner-side link sends Offers whose payloads
are synthetic outer gradients (float32 numpy, wire format "none") for the fragments of the
model's plan; one syncer (K = 1, no grace window, RDA + outer Nesterov) merges each offer at
once and replies to the learner. Measured on the learner's side:
  latency     one offer in flight: offer handed to the link -> Merged reply in its inbox
              (includes the syncer's merge, shown separately as "merge")
  throughput  R rounds of all P fragments, the P fragments in flight at once, each next
              offer of a fragment sent when its reply is in (as a learner's next offer
              carries the last reply's version): offer bytes per second until the last
              reply arrived (every reply carries as many bytes back), and merges/s
  offers      made at the learner's schedule steps (each one a new slot of its fragment)
              with the last reply's version and syncer epoch
  local       LocalLearnerLink -> queue -> syncer thread -> queue (one process, no copies)
  ray         a learner actor (own process) with RayLearnerLink -> SyncerActor (own
              process) -> the learner's mailbox: pickling, object store, two processes
Models: "tiny" (~140k params, P = 2) and "100m" (d 768, 12 layers, vocab 32k: ~110M
params, P = 4, ~110 MB per fragment).

The learner overhead on Ray is scripts/bench_ray_overhead.py.
"""

import os
import queue
import statistics
import tempfile
import threading
import time

from decoupled_diloco import cli  # noqa: E402  (imports no JAX)

cli.xla_flags()  # before JAX starts: 8 fake CPU devices, no CUDA graphs

import numpy as np  # noqa: E402
import ray  # noqa: E402
from absl import flags, logging  # noqa: E402

from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco.config import RayConfig  # noqa: E402
from decoupled_diloco.diloco import compression  # noqa: E402
from decoupled_diloco.diloco.fragments import model_plan  # noqa: E402
from decoupled_diloco.diloco.messages import Join, Merged, Offer, Snapshot  # noqa: E402
from decoupled_diloco.runtime.ray import cluster as ray_cluster  # noqa: E402
from decoupled_diloco.runtime.ray import links as ray_links  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "Fewer rounds (3).")
_MODELS = flags.DEFINE_list("models", ["tiny", "100m"], "Models for the round trips.")
_ROUNDS = flags.DEFINE_integer("rounds", None, "Round trips per fragment (default 10; quick 3).")

MODELS = {
    "tiny": ({"model.preset": "tiny"}, 2),
    "100m": (
        {
            "model.preset": "tiny",
            "model.vocab_size": 32_768,
            "model.d_model": 768,
            "model.num_layers": 12,
            "model.num_heads": 12,
            "model.num_kv_heads": 12,
            "model.head_dim": 64,
            "model.ffw_hidden": 2048,
            "model.sliding_window": 128,
        },
        4,
    ),
}


def _config(over: dict):
    c = config_lib.default_config()
    c.update_from_flattened_dict(over)  # {"a.b": value}
    return c


def transport_run(model: str):
    over, P = MODELS[model]
    return config_lib.validate(
        _config(
            {
                **over,
                "runtime": "ray",
                "diloco.learners": 1,
                "diloco.sync_every": P,
                "diloco.fragments": P,
                "diloco.quorum": 1,
                "diloco.grace_gamma": 0.0,
                "diloco.max_staleness": 1_000_000,  # pipelined offers run ahead of replies
                "diloco.syncer_checkpoint_seconds": 1e9,  # no checkpoints inside the timing
            }
        )
    )


# --- part 1: round trips -------------------------------------------------------------------
class Prober:
    """The learner's side of the round trips, over any LearnerLink whose inbox is `inbox`.

    Offers follow the learner's schedule: fragment p's r-th offer is made at step
    offset_p + r * H, so each belongs to a new schedule slot and opens a round of its own,
    and it carries the version and syncer epoch of the last reply for p, as a learner's
    would (the syncer rejects offers anchored on another syncer life).
    """

    def __init__(self, link, inbox: queue.Queue, names: list, shapes: dict, offsets, H: int):
        self.link, self.inbox, self.names = link, inbox, names
        self.offsets, self.H = list(offsets), H
        rng = np.random.default_rng(0)
        self.payloads = [
            compression.encode(
                {k: 1e-3 * rng.standard_normal(shapes[k]).astype(np.float32) for k in group},
                "none",
            )
            for group in names
        ]
        self.version = [0] * len(names)
        self.epoch = [0] * len(names)
        self.rounds = [0] * len(names)

    def _offer(self, p: int) -> Offer:
        self.rounds[p] += 1
        return Offer(
            learner=0,
            incarnation=0,
            fragment=p,
            step=self.offsets[p] + self.rounds[p] * self.H,
            c_steps=self.H,
            c_tokens=self.H,
            base_version=self.version[p],
            time=time.monotonic(),
            payload=self.payloads[p],
            nbytes=self.payloads[p].nbytes(),
            epoch=self.epoch[p],
        )

    def _take(self, reply: Merged) -> None:
        if reply.version >= self.version[reply.fragment]:
            self.version[reply.fragment] = reply.version
            self.epoch[reply.fragment] = reply.epoch

    def _next(self, kind) -> object:
        while True:
            msg = self.inbox.get()
            if isinstance(msg, kind):
                return msg

    def join(self) -> None:
        self.link.send(Join(0, 0, 0.0))
        snap = self._next(Snapshot)
        versions = snap.versions
        if not isinstance(versions, dict):
            versions = dict(enumerate(versions))
        for p, v in versions.items():
            self.version[int(p)], self.epoch[int(p)] = v, snap.epoch

    def latency(self, rounds: int) -> list[tuple[int, float]]:
        """(fragment, seconds) per sequential round trip."""
        out = []
        for _ in range(rounds):
            for p in range(len(self.names)):
                t = time.perf_counter()
                self.link.send(self._offer(p))
                reply = self._next(Merged)
                out.append((p, time.perf_counter() - t))
                self._take(reply)
        return out

    def throughput(self, rounds: int) -> tuple[float, int]:
        """(seconds, offer bytes) for `rounds` offers of every fragment, all P fragments in
        flight at once, each next offer of p sent as soon as p's reply is in. (Not more per
        fragment: an offer carries the version of the last reply, and the syncer drops a
        second offer anchored on a version it has merged an offer on already.)"""
        P = len(self.names)
        left = [rounds] * P
        t = time.perf_counter()
        for p in range(P):
            self.link.send(self._offer(p))
            left[p] -= 1
        for _ in range(rounds * P):
            reply = self._next(Merged)
            self._take(reply)
            if left[reply.fragment]:
                self.link.send(self._offer(reply.fragment))
                left[reply.fragment] -= 1
        seconds = time.perf_counter() - t
        return seconds, rounds * sum(x.nbytes() for x in self.payloads)


@ray.remote(num_cpus=0, max_concurrency=4)
class RayProber:
    """A learner process holding the prober; the syncer delivers into its inbox."""

    def __init__(self, syncer_name: str, names: list, shapes: dict, offsets, H: int):
        self.inbox: queue.Queue = queue.Queue()
        link = ray_links.RayLearnerLink(0, [syncer_name], lambda n: 0.0)
        link.inbox = self.inbox
        self.prober = Prober(link, self.inbox, names, shapes, offsets, H)

    def deliver(self, msg) -> None:
        self.inbox.put(msg)

    def run(self, rounds: int):
        self.prober.join()
        return self.prober.latency(rounds), self.prober.throughput(rounds)


def roundtrip_local(run, rounds: int, names, shapes):
    from decoupled_diloco.checkpoint import Checkpointer
    from decoupled_diloco.runtime.links import LocalLearnerLink, LocalSyncerLink
    from decoupled_diloco.runtime.ray.syncer import initial_params
    from decoupled_diloco.runtime.syncer_loop import SyncerLoop

    merges: list[float] = []

    def record(rec):
        if rec.get("event") == "merge":
            merges.append(rec["merge_seconds"])

    plan = model_plan(run.model, run.diloco)
    syncer_inbox: queue.Queue = queue.Queue()
    link = LocalLearnerLink(0, [syncer_inbox], lambda p: 0)
    slink = LocalSyncerLink(syncer_inbox, {0: link.inbox})
    ckpt = Checkpointer(tempfile.mkdtemp(prefix="dd_bench_rt_"))
    serve = SyncerLoop(0, run, plan, initial_params(run), slink, ckpt, _NoFaults(),
                       time.monotonic, record, emulate_outages=False)  # fmt: skip
    stop = threading.Event()
    thread = threading.Thread(target=serve.run, args=(stop,), daemon=True)
    thread.start()
    prober = Prober(link, link.inbox, names, shapes, plan.offsets, plan.sync_every)
    prober.join()
    out = prober.latency(rounds), prober.throughput(rounds)
    stop.set()
    thread.join()
    ckpt.close()
    return (*out, merges)


class _NoFaults:
    """A fault schedule in which the syncer is always up."""

    def syncer_up(self, t: float) -> bool:
        return True


def roundtrip_ray(run, rounds: int, names, shapes):
    from decoupled_diloco.runtime.ray.syncer import SyncerActor

    run_id = f"bench{os.getpid()}"
    name = ray_links.actor_name(run_id, "syncer", 0)
    opts = ray_cluster.syncer_options(ray.cluster_resources(), 1, 0)
    ckpt = tempfile.mkdtemp(prefix="dd_bench_rt_")
    syncer = (
        ray.remote(SyncerActor).options(name=name, **opts).remote(0, run, ckpt, run_id, time.time())
    )
    plan = model_plan(run.model, run.diloco)
    prober = RayProber.options(name=ray_links.actor_name(run_id, "learner", 0)).remote(
        name, names, shapes, plan.offsets, plan.sync_every
    )
    latency, throughput = ray.get(prober.run.remote(rounds))
    records = ray.get(syncer.poll.remote())["records"]
    merges = [r["merge_seconds"] for r in records if r.get("event") == "merge"]
    for actor in (prober, syncer):
        ray.kill(actor)
    return latency, throughput, merges


def roundtrips(models: list[str], rounds: int) -> None:
    print("\n== fragment round trip (offer -> merged reply), K=1, wire format none ==")
    head = f"{'model':6} {'runtime':7} {'P':>2} {'MB/frag':>8} {'latency ms (med / p90)':>23} "
    print(head + f"{'merge ms':>9} {'throughput MB/s':>16} {'merges/s':>9}")
    for model in models:
        run = transport_run(model)
        plan = model_plan(run.model, run.diloco)
        from decoupled_diloco.runtime.ray.syncer import initial_params

        shapes = {k: v.shape for k, v in initial_params(run).items()}
        names = [list(g) for g in plan.names]
        mb = statistics.mean(sum(4 * np.prod(shapes[k]) for k in g) for g in names) / 1e6
        for runtime, fn in (("local", roundtrip_local), ("ray", roundtrip_ray)):
            latency, (seconds, nbytes), merges = fn(run, rounds, names, shapes)
            lat = sorted(s for _, s in latency)
            p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
            print(
                f"{model:6} {runtime:7} {len(names):>2} {mb:8.2f} "
                f"{1e3 * statistics.median(lat):11.1f} / {1e3 * p90:9.1f} "
                f"{1e3 * statistics.median(merges):9.1f} {nbytes / seconds / 1e6:16.1f} "
                f"{rounds * len(names) / seconds:9.1f}",
                flush=True,
            )


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    rounds = _ROUNDS.value or (3 if _QUICK.value else 10)
    from decoupled_diloco import compile_cache

    compile_cache.enable()
    started = ray_cluster.connect(RayConfig(num_cpus=2), verbose=False)
    try:
        roundtrips(_MODELS.value, rounds)
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    cli.run_script(main)
