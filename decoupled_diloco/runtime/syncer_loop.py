"""One syncer shard's life, for every runtime: serve, checkpoint, die, restore, finish.

A `Syncer` is pure logic; this loop owns everything around it. The local runtime runs it on
a host thread and emulates the fault schedule's syncer outages here (the shard's memory is
dropped; learners keep training and queue their messages; it restores from its last
checkpoint). Under Ray the outage is real (the driver kills the actor's process) and the
restarted process's loop restores at start and waits out the scheduled outage.

Checkpoints (orbax, `fragment_checkpoint.py`) are streamed from a saver thread, so the
serving thread never writes one: every `diloco.syncer_checkpoint_seconds` the saver copies
one fragment (Θ, momentum, version, slot, vector clock) under the lock, writes it outside
the lock while merges of every fragment go on, takes the next, and commits a manifest with
the counters and event-log position taken when the save began and the learner registry as
it is at the commit (a learner that left finished meanwhile never says so again). A save of s
seconds puts the next one at least s / `diloco.syncer_checkpoint_duty` after its start
(`checkpoint_gap`), so however large the model, writing checkpoints takes at most that
share of the syncer host's time (and of its GIL). s is the shorter of the last two saves
that held merges (none stretches the gap before two have): one slowed by something passing
(the learners' compilation, which the first saves meet) does not space out the ones after
it. Extra memory:
one fragment's Θ + momentum. A save is skipped while neither the versions nor the registry
changed; a save the syncer's death interrupts is never committed. The event-log position
is that of the save's start: records up to it are in the checkpoint; a merge recorded after
it is in it iff its version is at most its fragment's restored version.
"""

import secrets
import threading
import time

from decoupled_diloco.diloco import syncer_state
from decoupled_diloco.diloco.offer_checks import RunBounds
from decoupled_diloco.diloco.syncer import Syncer, snapshot_bytes
from decoupled_diloco.diloco.transport import SyncerLink
from decoupled_diloco.fragment_checkpoint import FragmentCheckpointer
from decoupled_diloco.runtime.links import CLOSE_TIMEOUT_S, join_thread

POLL_S = 0.02  # seconds: longest block on the inbox, and the poll while down


def checkpoint_gap(interval: float, save_seconds: float, duty: float) -> float:
    """Seconds from the start of one checkpoint to the start of the next: the configured
    interval, or longer after a save that would otherwise take more than `duty` of the
    time."""
    return max(interval, save_seconds / duty)


def owned_fragments(num_fragments: int, shards: int, shard: int) -> list[int]:
    """Fragments of syncer shard `shard`: p with p mod S == shard."""
    return [p for p in range(num_fragments) if p % shards == shard]


def new_epoch() -> int:
    """A fresh syncer life's epoch: unique with overwhelming probability, never 0."""
    return 1 + secrets.randbelow(2**62)


class SyncerLoop:
    """Shard `shard` of the run's syncer. `record` takes its merge and event records."""

    def __init__(
        self,
        shard,
        run,
        plan,
        init_params,
        link: SyncerLink,
        ckpt: FragmentCheckpointer,
        schedule,
        clock,
        record,
        *,
        emulate_outages: bool,
        restarted: bool = False,
        before_commit=None,
    ):
        """`before_commit()`: called before a checkpoint commits; False: it does not (Ray's
        actor waits there until the driver has taken the records of the merges it holds; a
        syncer process whose parent is gone refuses)."""
        self.shard, self.run_cfg, self.plan, self.init_params = shard, run, plan, init_params
        self.before_commit = before_commit
        self.link, self.ckpt, self.schedule, self.clock = link, ckpt, schedule, clock
        self.record, self.emulate_outages = record, emulate_outages
        self.lock = threading.Lock()  # around the Syncer: its loop vs. readers of Θ and stats
        self._saved_key = None
        self._saver: threading.Thread | None = None  # the checkpoint being written, if any
        self._saver_error: BaseException | None = None
        self._save_times: list[float] = []  # seconds of the last two saves holding merges
        self._abandoned = False  # the loop failed: no save commits any more
        # Bytes the ended lives of this loop's syncer received and sent (a life's count dies
        # with it; the checkpoint does not keep it: the traffic after the save happened too).
        self._past_traffic = {"bytes_in": 0, "bytes_out": 0}
        self.syncer: Syncer | None = self._restore(after_failure=restarted)
        self.restarted = restarted

    # --- the loop ---------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Serves until `stop`, then merges what is pending and saves a final checkpoint."""
        try:
            self._serve(stop)
        except BaseException:
            # A failed syncer is a dead one: the save it was writing is never committed, and
            # its thread ends before the failure is raised. Left writing, it went on past
            # the failed run (whose runtime closes the checkpointer next, and whose workdir
            # lock is then released) and committed a checkpoint into it afterwards.
            self._abandon_save()
            raise

    def _serve(self, stop: threading.Event) -> None:
        if self.restarted:  # a restarted process: wait out the outage, then announce
            while not self.schedule.syncer_up(self.clock()) and not stop.is_set():
                time.sleep(POLL_S)
            self._announce()
        last_ckpt = self.clock()
        # Outages begun before this loop's start are behind it (or it starts in one).
        crashes = self.schedule.syncer_crashes_by(last_ckpt)[0] if self.emulate_outages else 0
        while not stop.is_set():
            now = self.clock()
            if self.emulate_outages:
                # A crash shows as an outage, or (one shorter than a turn) as a new count.
                seen, (crashes, last) = crashes, self.schedule.syncer_crashes_by(now)
                if crashes > seen or not self.schedule.syncer_up(now):
                    self._outage(last)
                    continue
            if self.syncer is None:  # back from an emulated outage
                self._set(self._restore(after_failure=True))
                self._announce()
            self.serve_turn()
            if self._saving():
                continue  # the gap after a save counts that save's time, known once it ends
            d = self.run_cfg.diloco
            gap = checkpoint_gap(d.syncer_checkpoint_seconds, self.save_seconds,
                                 d.syncer_checkpoint_duty)  # fmt: skip
            if self.clock() - last_ckpt >= gap and self.save_in_background():
                last_ckpt = self.clock()
        self.wait_for_save()
        if self.syncer is None:  # the run ended during an outage: come back to finish
            self._set(self._restore(after_failure=True))
        with self.lock:  # end of run: merge what is still pending, quorum or not
            out = self.syncer.handle_batch(self.link.receive(0.0), self.clock)
            out += self.syncer.flush(self.clock())
        self._send(out)
        self.save()

    def serve_turn(self, max_block: float = POLL_S) -> None:
        """Receives what arrived (blocking until the next grace deadline, at most
        `max_block` s), handles it, closes due rounds and sends the replies."""
        deadline = self.syncer.next_deadline()
        timeout = (
            max_block if deadline is None else min(max(deadline - self.clock(), 0.0), max_block)
        )
        msgs = self.link.receive(timeout)
        with self.lock:
            out = self.syncer.handle_batch(msgs, self.clock)
        self._send(out)

    def _send(self, out) -> None:
        for m, msg in out:
            self.link.send(m, msg)

    def _outage(self, began: float | None = None) -> None:
        """`began`: when the last outage began (one already over still happened)."""
        if self.syncer is not None:  # the syncer process dies: its memory is gone
            now = self.clock()  # when this loop saw it; `down_since`: when it happened
            since = self.schedule.syncer_down_since(now)
            since = next((x for x in (since, began) if x is not None), now)
            # Negative: an outage an earlier attempt of the run began (and counted) goes on.
            earlier = {"earlier_attempt": True} if since < 0 else {}
            self.record({"event": "syncer_crash", "shard": self.shard, "time": now,
                         "down_since": since, **earlier})  # fmt: skip
            self._set(None)
        time.sleep(POLL_S)  # learners keep training; their messages queue up

    def _set(self, syncer: Syncer | None) -> None:
        with self.lock:
            if self.syncer is not None:  # a life ends: its traffic stays counted
                for k in self._past_traffic:
                    self._past_traffic[k] += self.syncer.stats[k]
            self.syncer = syncer

    def _announce(self) -> None:
        """A new life: every learner the restored registry knows gets a snapshot (learners
        that joined after the checkpoint re-register with their next heartbeat), those that
        left too: one still in its final sync waits for offers the lost life never merged,
        and offers them again on the snapshot (a learner that is gone never reads it)."""
        with self.lock:
            snap = self.syncer.snapshot(self.clock())
            known = list(self.syncer.learners)
            self.syncer.stats["bytes_out"] += snapshot_bytes(snap) * len(known)
        for m in known:
            self.link.send(m, snap)

    # --- Θ for evaluation and stats ---------------------------------------------------
    def global_params(self) -> dict | None:
        """A copy of this shard's Θ, keyed by fragment member (join the shards' with
        `fragment_members.join_members` for whole leaves); None while the shard is down."""
        with self.lock:
            if self.syncer is None:
                return None
            return {k: v.copy() for k, v in self.syncer.global_params().items()}

    def stats(self) -> dict:
        """The syncer's counters, and `held_merges`: the merges its Θ holds (one version
        each; a restore re-creates the numbers it lost), over every attempt of the run;
        `bytes_in` / `bytes_out` over every life of this loop (this attempt's traffic)."""
        with self.lock:
            if self.syncer is None:
                return {}
            return {**self.syncer.stats, **self._traffic(),
                    "held_merges": sum(self.syncer.version.values())}  # fmt: skip

    def bytes_communicated(self) -> int:
        """Bytes received and sent by every life of this loop's syncer so far (also while it
        is down)."""
        return sum(self.traffic().values())

    def traffic(self) -> dict:
        """`bytes_in` / `bytes_out` of every life of this loop's syncer so far."""
        with self.lock:
            return self._traffic()

    def _traffic(self) -> dict:
        now = self.syncer.stats if self.syncer is not None else {}
        return {k: n + now.get(k, 0) for k, n in self._past_traffic.items()}

    def close(self) -> None:
        """After `run`: releases the checkpointer."""
        self.ckpt.close()

    # --- checkpoints ------------------------------------------------------------------
    def _restore(self, after_failure: bool) -> Syncer:
        """A new life: a new epoch, then the latest checkpoint if there is one."""
        self.wait_for_save()  # (one whose life ended gives up at its next fragment)
        run = self.run_cfg
        owned = owned_fragments(self.plan.num_fragments, run.diloco.syncer_shards, self.shard)
        bounds = RunBounds(tokens_per_step=run.train.batch_size * run.data.seq_len,
                           max_step=run.train.steps)  # fmt: skip
        syncer = Syncer(run.diloco, self.plan, self.init_params, owned, self.record, new_epoch(),
                        bounds)  # fmt: skip
        if self.ckpt.latest_step() is not None:
            try:
                state, meta = syncer_state.join_parts(*self.ckpt.restore())
            finally:
                for step, reason, moved in self.ckpt.refused:
                    self.record({"event": "checkpoint_refused", "shard": self.shard,
                                 "checkpoint_step": step, "reason": reason, "moved_to": moved,
                                 "time": self.clock()})  # fmt: skip
                self.ckpt.refused.clear()
            syncer.load_state_dict(state, meta, self.clock())
            self._saved_key = _saved_key(syncer)
        elif not after_failure:
            return syncer  # a fresh run
        self.record(
            {
                "event": "syncer_restore",
                "shard": self.shard,
                "versions": dict(syncer.version),
                "epoch": syncer.epoch,
                "after_failure": after_failure,
                # merges.jsonl / events.jsonl records of this shard after this many were
                # rolled back (merges the lost life made after its checkpoint)
                "log_position": syncer.log_position,
                "time": self.clock(),
            }
        )
        return syncer

    def _saving(self) -> bool:
        """A checkpoint is being written on the saver thread."""
        return self._saver is not None and self._saver.is_alive()

    def save_in_background(self) -> bool:
        """Starts a checkpoint on the saver thread; False while the previous one is still
        being written. Re-raises what made the previous one fail."""
        if self._saving():
            return False
        self.wait_for_save()
        self._saver = threading.Thread(target=self._save_or_keep_error, daemon=True,
                                       name=f"syncer{self.shard}-checkpoint")  # fmt: skip
        self._saver.start()
        return True

    def _abandon_save(self) -> None:
        """Makes the checkpoint being written give up at its next fragment, uncommitted,
        and waits (a bounded time) for its thread; what made it fail, if anything, goes
        with it (the caller raises its own failure)."""
        self._abandoned = True
        join_thread(self._saver, CLOSE_TIMEOUT_S, f"syncer{self.shard}-checkpoint")
        self._saver, self._saver_error = None, None

    def wait_for_save(self) -> None:
        """Waits for the checkpoint being written; re-raises what made it fail (a syncer
        whose checkpoints fail must fail, as one whose merges fail)."""
        if self._saver is not None:
            self._saver.join()
            self._saver = None
        error, self._saver_error = self._saver_error, None
        if error is not None:
            raise error

    @property
    def save_seconds(self) -> float:
        """What a save costs, for `checkpoint_gap`: the shorter of the last two that held
        merges (0 before two have)."""
        return min(self._save_times) if len(self._save_times) == 2 else 0.0

    def _save_or_keep_error(self) -> None:
        start = time.monotonic()
        try:
            wrote = self.save()
        except BaseException as e:  # surfaced on the serving thread by wait_for_save
            self._saver_error, wrote = e, False
        if wrote and any(v for _, v in self._saved_key[0]):
            self._save_times = [*self._save_times[-1:], time.monotonic() - start]

    def save(self) -> bool:
        """Writes a checkpoint, one fragment at a time (see the module docstring); False if
        nothing changed since the last one, the syncer is down or died meanwhile, or a
        fragment was not finite."""
        with self.lock:
            life = self.syncer
            if life is None:
                return False
            registry = _registry_key(life)
            if (tuple(sorted(life.version.items())), registry) == self._saved_key:
                return False
            meta = syncer_state.shared_meta(life)
        n = self.ckpt.begin()
        entries, versions = {}, {}
        for p in life.owned:
            with self.lock:
                if self.syncer is not life or self._abandoned:  # this life died: its save
                    return False  # is never committed
                arrays, info = syncer_state.fragment_part(life, p)
            entries[p] = self.ckpt.write_fragment(n, p, arrays, info)
            del arrays  # before the next fragment's copy: one fragment at a time
            if entries[p] is None:
                return False
            versions[p] = info["version"]
        if self.before_commit is not None and not self.before_commit():
            return False
        with self.lock:  # the registry as it is now: a learner that left finished while
            if self.syncer is not life or self._abandoned:  # the fragments were written
                return False  # never sends it again
            meta["learners"], registry = syncer_state.registry_meta(life), _registry_key(life)
        self.ckpt.commit(n, entries, meta)
        self._saved_key = tuple(sorted(versions.items())), registry
        return True


def _registry_key(syncer: Syncer) -> tuple:
    return tuple(
        sorted((m, i.incarnation, i.joined, i.finished) for m, i in syncer.learners.items())
    )


def _saved_key(syncer: Syncer) -> tuple:
    """What a checkpoint must hold; a save is skipped while it has not changed."""
    return tuple(sorted(syncer.version.items())), _registry_key(syncer)
