"""A syncer shard in a process of its own, for the local runtime (`local_syncer`).

The local runtime runs learners on threads of one interpreter. A syncer on a thread beside
them shares their interpreter lock: a merge makes a few hundred numpy calls, each of which
must take the lock back from threads dispatching steps, so on one H100 host a `mid` merge
that takes 15 ms alone took 123 ms beside four learners, merges came back 9-18 steps late
and the decoupled arm trained a worse model (experiments/README.md, issue 12). In a process
of its own the syncer has its own interpreter and the host's other cores; the learners'
process keeps only the hand-over: the `SyncerProcess` here forwards what arrives in the
shard's inbox (after the fault schedule's link delays, as before) over a `Wire`, and passes
the replies on to the learners' links. Offers and merged fragments cross through shared
memory with copies that run without the interpreter lock (`wire.py`).

What it costs, measured on the 2-core dev box (2026-11-27): every offer and every merge is
copied twice more (into shared memory and out of it), ~75 MB per `mid` merge of two offers.
`bench_syncer_merge.py --part=gil`: a `mid` round (2 offers across, merge, Θ back) took
47.6 ms beside four busy threads where the same merge on a thread beside them took 30.3 ms.
`bench_accelerator.py --part=fleet --emulate_step_ms=10.4` (four `mid` learners at the
H200's step rate): 33.3 / 29.8 steps per offer with the syncer in a process against 11.7 /
11.4 on a thread (H = 12), offers merged 1.5-1.7 s after they were made against 0.2-0.3 s:
there the copies, not the lock, use up the cores (experiments/results/fleet_emulated/). So
a thread is the default; a process may pay on a host with cores to spare whose learner
threads keep the lock busy, which no GPU run has measured yet (`device_check.sh speed` runs
the fleet both ways).

The child runs the same `SyncerLoop` as a syncer thread does (emulated outages included;
a step schedule's outages are forwarded as the learners reach them; checkpoints in the same
directory), so a run's results do not depend on where its syncer runs: a synchronous run
gives the same merges and loss to the bit (tests/test_syncer_process.py). Records go back
to the parent, which writes them as a thread's would. The child is started with "spawn"
(never fork a process whose threads run XLA) while the learners are built, so its imports
overlap their compilation, and uses JAX, if at all, on the CPU: the learners' accelerator
stays theirs. A child whose parent is gone (killed) ends without another checkpoint: the
records of its last merges have nowhere to go, and a resume must not restore a Θ holding
merges that merges.jsonl lacks. Its shared-memory segments, should the kill take
multiprocessing's resource tracker with it, are removed by the next run (`wire.py`).
"""

import contextlib
import itertools
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback

from decoupled_diloco.runtime import wire as wire_lib
from decoupled_diloco.runtime.links import _drain
from decoupled_diloco.runtime.wire import Wire, WireClosedError

POLL_S = 0.02  # seconds: the forwarder's longest block on the inbox
SETTLE_S = 600.0  # how long the child's last words wait for the parent to copy Θ


class SyncerProcessError(RuntimeError):
    """The syncer's process failed or died; the message holds its traceback or exit code."""


class SyncerProcess:
    """The parent's end of shard `shard`: what the local runtime asks of a `SyncerLoop`
    (`run`, `global_params`, `stats`, `close`), served by a process.

    `start(init_params, t0)` hands the child Θ_0, the run's clock origin and where it
    starts on the fault timeline (`schedule.offset`: the child draws the same one); `run(stop)`
    forwards messages until `stop`, then has the child merge what is pending, save and
    report, and returns its final Θ and stats for `global_params` and `stats`."""

    def __init__(self, shard: int, run, plan, link, ckpt_dir: str, record, schedule):
        self.shard, self.link, self.record, self.schedule = shard, link, record, schedule
        self._outages_sent = 0
        self._freeze_sent = False
        wire_lib.sweep_orphans()  # segments an earlier run's kill -9 left behind
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_child_main,
            args=(theirs, shard, run, plan, str(ckpt_dir)),
            name=f"syncer{shard}",
            daemon=True,
        )
        with _stop_signals_ignored():
            self.process.start()
        theirs.close()
        self.wire = Wire(ours)
        self._requests = itertools.count()
        self._answers: dict[int, list] = {}  # request id -> [event, answer]
        self._answers_lock = threading.Lock()
        self._done = threading.Event()
        self._final: dict | None = None  # {"params", "stats"} from the child's last words
        self._error: str | None = None
        self._last_reply = None
        self._reader: threading.Thread | None = None
        self._traffic: dict = {}  # the child's traffic as its last reply said

    # --- the run ----------------------------------------------------------------------
    def start(self, init_params: dict, t0: float) -> None:
        self.wire.send("start", init_params, t0=t0, fault_offset_s=self.schedule.offset)
        self._reader = threading.Thread(
            target=self._read, name=f"syncer{self.shard}-replies", daemon=True
        )
        self._reader.start()

    def run(self, stop: threading.Event) -> None:
        """Forwards the shard's inbox to the child until `stop`, then finishes it."""
        try:
            while not stop.is_set() and not self._done.is_set():
                self._send_outages()
                msgs = self.link.receive(POLL_S)
                if msgs:
                    self.wire.send("msgs", msgs)
            if not self._done.is_set():
                msgs = self.link.receive(0.0)
                if msgs:
                    self.wire.send("msgs", msgs)
                self.wire.send("stop")
        except WireClosedError:
            pass  # the reader says why
        # The final merges and checkpoint take what they take; a dead child ends the wait
        # (the reader sees the pipe close).
        while not self._done.wait(1.0):
            if not self.process.is_alive() and not self._reader.is_alive():
                self._error = self._error or f"exited with code {self.process.exitcode}"
                break
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
        if self._error is not None:
            raise SyncerProcessError(f"syncer shard {self.shard}'s process: {self._error}")

    def _send_outages(self) -> None:
        """A step schedule's syncer outages are placed on the timeline as the learners reach
        their steps, in this process's schedule: the child's copy learns them from here (a
        seconds schedule is the same in both from the start), and its freeze (a Ctrl-C)."""
        down = list(self.schedule.syncer_down)
        if len(down) != self._outages_sent:
            self.wire.send("outages", down)
            self._outages_sent = len(down)
        frozen = self.schedule.frozen_at
        if frozen is not None and not self._freeze_sent:
            self.wire.send("freeze", None, t=frozen)
            self._freeze_sent = True

    def _read(self) -> None:
        """The replies thread: replies to learners, records, answers, last words."""
        try:
            while True:
                kind, meta, obj = self.wire.recv()
                if kind in ("reply", "again"):
                    self._traffic = meta.get("traffic", self._traffic)
                if kind == "reply":
                    self._last_reply = obj
                    self.link.send(meta["learner"], obj)
                elif kind == "again":  # the reply before, to one more learner
                    self.link.send(meta["learner"], self._last_reply)
                elif kind == "record":
                    self.record(obj)
                elif kind == "answer":
                    with self._answers_lock:
                        slot = self._answers.pop(meta["id"], None)
                    if slot is not None:
                        slot[1] = obj
                        slot[0].set()
                elif kind == "done":
                    self._final = obj
                    break
                elif kind == "error":
                    self._error = f"failed:\n{obj}"
                    break
        except WireClosedError:  # before its last words ("done" or "error")
            self.process.join(timeout=5)
            self._error = f"exited with code {self.process.exitcode} before the run ended"
        except BaseException:  # the hand-over itself failed: the run must not go on blind
            self._error = f"its replies could not be handed over:\n{traceback.format_exc()}"
        finally:
            with self._answers_lock:  # nobody waits for an answer that cannot come
                self._done.set()
                for slot in self._answers.values():
                    slot[0].set()
                self._answers.clear()

    # --- what the runtime reads -------------------------------------------------------
    def global_params(self) -> dict | None:
        """A copy of this shard's Θ (fragment members); None while the shard is down."""
        request = next(self._requests)
        slot = [threading.Event(), None]
        with self._answers_lock:  # the reader's end sets `_done` under this lock
            if self._done.is_set():
                return None if self._final is None else self._final["params"]
            self._answers[request] = slot
        try:
            self.wire.send("params", id=request)
        except WireClosedError:
            return None
        while not slot[0].wait(1.0):
            if not self.process.is_alive():
                return None
        return slot[1]

    def stats(self) -> dict:
        return {} if self._final is None else dict(self._final["stats"])

    def bytes_communicated(self) -> int:
        """The child's traffic: from its last words, before them as its last reply said (a
        killed attempt's heartbeat keeps it)."""
        stats = self.stats() or self._traffic
        return stats.get("bytes_in", 0) + stats.get("bytes_out", 0)

    def close(self) -> None:
        """Ends the process if it still runs, then closes the wire (idempotent). The
        segments of a child that did not end cleanly are unlinked here: its own cleanup never
        ran, and multiprocessing's would wait for this process to exit."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.wire.close(unlink_mapped=self.process.exitcode != 0)


@contextlib.contextmanager
def _stop_signals_ignored():
    """Starts a child with SIGINT and SIGTERM ignored from its first instruction: a
    terminal's Ctrl-C reaches the whole process group (a scheduler's SIGTERM may too), and
    one while the child still imported (before it could ignore it itself) killed it,
    turning the run's orderly stop into a failure. (Python keeps an ignore it inherits.)
    The parent stops the run, then the child; a child whose parent is gone ends itself. The
    parent's own handlers are back once the child is started (a signal in those
    milliseconds is lost to the parent too); only its main thread may change them,
    elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


class _PipeSyncerLink:
    """The child's `SyncerLink`: messages the parent forwarded; replies back over the wire.

    One merge's reply goes to every live learner as the same object: it crosses once, and
    the parent hands that object to each of them."""

    def __init__(self, wire: Wire):
        self.wire, self.inbox = wire, queue.Queue()
        self._last = None
        self._lock = threading.Lock()  # "again" refers to the previous send: one at a time
        self.traffic = dict  # the loop's traffic so far (set once the loop exists)

    def receive(self, timeout: float) -> list:
        return _drain(self.inbox, timeout)

    def send(self, learner: int, msg) -> None:
        """(Dropped once the parent is gone: its learners went with it.)"""
        with self._lock, contextlib.suppress(WireClosedError):
            traffic = self.traffic()
            if msg is self._last:
                self.wire.send("again", learner=learner, traffic=traffic)
            else:
                self.wire.send("reply", msg, learner=learner, traffic=traffic)
                self._last = msg


def _child_main(conn, shard: int, run, plan, ckpt_dir: str) -> None:
    """The child process: waits for Θ_0 and the clock, then runs the shard's loop."""
    import jax

    # A terminal's Ctrl-C (or a SIGTERM to the group) reaches this process too: the parent
    # stops the run (the learners' final offers still need this shard), then stops this
    # process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    jax.config.update("jax_platforms", "cpu")  # the learners' accelerator stays theirs

    from decoupled_diloco import faults
    from decoupled_diloco.fragment_checkpoint import FragmentCheckpointer
    from decoupled_diloco.runtime import gil
    from decoupled_diloco.runtime.syncer_loop import SyncerLoop

    gil.set_switch_interval(run.gil_switch_ms)  # its own threads: saver, merge threads
    wire = Wire(conn)
    try:
        kind, meta, init_params = wire.recv()  # no timeout: a parent that dies closes the pipe
        if kind != "start":
            raise RuntimeError(f"a syncer process got {kind!r} before 'start'")
        t0 = meta["t0"]
        link = _PipeSyncerLink(wire)
        schedule = faults.FaultSchedule(
            run.faults, run.num_learners, faults.HORIZON_S, meta["fault_offset_s"]
        )

        # The parent is gone (killed): the records of merges made since have nowhere to
        # go, so no checkpoint may hold those merges (a resume would restore a Θ that
        # merges.jsonl and the work accounting do not know); the loop ends without saving.
        parent_gone = threading.Event()

        def to_parent(kind: str, obj) -> bool:
            """Sends to the parent; False once it is gone."""
            try:
                wire.send(kind, obj)
                return True
            except WireClosedError:
                parent_gone.set()
                return False

        loop = SyncerLoop(
            shard, run, plan, init_params, link, FragmentCheckpointer(ckpt_dir), schedule,
            lambda: time.monotonic() - t0,  # CLOCK_MONOTONIC: the parent's clock too
            lambda rec: to_parent("record", rec),
            emulate_outages=True,
            before_commit=lambda: not parent_gone.is_set(),
        )  # fmt: skip
        link.traffic = loop.traffic
        stop = threading.Event()

        def serve_parent() -> None:
            try:
                while True:
                    kind, meta, obj = wire.recv()
                    if kind == "msgs":
                        for msg in obj:
                            link.inbox.put(msg)
                    elif kind == "outages":  # the parent's timeline (a step schedule's)
                        schedule.syncer_down = obj
                    elif kind == "freeze":  # the run stopped training (a Ctrl-C)
                        schedule.freeze(meta["t"])
                    elif kind == "params":
                        wire.send("answer", loop.global_params(), id=meta["id"])
                    elif kind == "stop":
                        break
            except WireClosedError:  # the parent is gone: end (saving nothing more)
                parent_gone.set()
            except BaseException:  # nobody would read the parent's messages: end the process
                with contextlib.suppress(WireClosedError):
                    wire.send("error", traceback.format_exc())
                os._exit(1)
            stop.set()

        threading.Thread(target=serve_parent, name="from-parent", daemon=True).start()
        loop.run(stop)
        loop.close()
        if to_parent("done", {"params": loop.global_params(), "stats": loop.stats()}):
            wire.settle(SETTLE_S)  # keep Θ's segment until the parent has copied it
    except BaseException:
        with contextlib.suppress(WireClosedError):
            wire.send("error", traceback.format_exc())
        raise
    finally:
        wire.close()
