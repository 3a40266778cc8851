"""A syncer loop that fails while its saver thread writes a checkpoint: the save is never
committed, and its thread has ended when the failure is raised (the runtime closes the
checkpointer next and reports the run failed; a thread left writing committed into it
afterwards)."""

import dataclasses
import threading
import types

import numpy as np
from test_syncer_checkpoint import CFG, PLAN, RUN, SHAPES, TOKENS, H, ListLink

from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.messages import Join, Offer
from decoupled_diloco.fragment_checkpoint import FragmentCheckpointer
from decoupled_diloco.runtime.syncer_loop import SyncerLoop


def test_a_syncer_that_fails_mid_checkpoint_leaves_no_saver_writing_and_commits_nothing(
    tmp_path,
):
    writing, release = threading.Event(), threading.Event()

    class HeldCheckpointer(FragmentCheckpointer):
        """Its first fragment's write waits for `release`."""

        def write_fragment(self, *args, **kwargs):
            writing.set()
            assert release.wait(30)
            return super().write_fragment(*args, **kwargs)

    class FailingLink(ListLink):
        """The second turn fails (a merge that raised), once the save is being written;
        the held write can go on a little later."""

        turns = 0

        def receive(self, timeout: float) -> list:
            self.turns += 1
            if self.turns == 1:
                return super().receive(timeout)
            assert writing.wait(30)
            threading.Timer(0.3, release.set).start()
            raise RuntimeError("the merge failed")

    run = types.SimpleNamespace(
        diloco=dataclasses.replace(CFG, syncer_checkpoint_seconds=1e-3), train=RUN.train,
        data=RUN.data,
    )  # fmt: skip
    ticks = iter(np.arange(1, 10_000) * 0.01)
    link, ckpt = FailingLink(), HeldCheckpointer(str(tmp_path))
    loop = SyncerLoop(0, run, PLAN, {k: np.zeros(s, np.float32) for k, s in SHAPES.items()},
                      link, ckpt, None, lambda: float(next(ticks)), lambda rec: None,
                      emulate_outages=False)  # fmt: skip
    rng = np.random.default_rng(0)
    v = {k: (0.01 * rng.standard_normal(SHAPES[k])).astype(np.float32) for k in PLAN.names[0]}
    link.inbox += [
        Join(0, 0, 0.0, 0, TOKENS),
        Offer(learner=0, incarnation=0, fragment=0, step=PLAN.offsets[0] + H, c_steps=H,
              c_tokens=H * TOKENS, base_version=0, time=0.0,
              payload=compression.encode(v, "none"), nbytes=1, epoch=loop.syncer.epoch),
    ]  # fmt: skip

    try:
        loop.run(threading.Event())
        raise AssertionError("the loop's failure was not raised")
    except RuntimeError as e:
        assert str(e) == "the merge failed"
        savers = [t for t in threading.enumerate() if t.name == "syncer0-checkpoint"]
        alive = [t for t in savers if t.is_alive()]
    assert loop.syncer.version[0] == 1  # the first turn merged: the save had work to hold
    release.set()
    for t in savers:
        t.join(30)
    assert not alive, "the failed syncer's saver thread was still writing"
    assert ckpt.all_steps() == [], "a checkpoint was committed after the syncer failed"
    ckpt.close()
