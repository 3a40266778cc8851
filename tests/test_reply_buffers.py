"""The syncer's reply buffers: reused only when no receiver can read them any more."""

import gc
import weakref

import numpy as np
import pytest

from decoupled_diloco.diloco import chunks, compression
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.messages import Offer
from decoupled_diloco.diloco.reply_buffers import ReplyBuffers
from decoupled_diloco.diloco.syncer import Syncer

LIKE = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float32)}


def test_a_reply_nobody_holds_is_reused_and_one_anybody_holds_is_not():
    pool = ReplyBuffers(spares=1)
    first, arrays = pool.take(0, LIKE)
    assert set(arrays) == set(LIKE) and arrays["w"].shape == (12,)
    first_id = id(first)
    del first, arrays
    again, _ = pool.take(0, LIKE)
    assert id(again) == first_id and (pool.reused, pool.fresh) == (1, 1)
    # Held as the Encoded (a message in a queue), as a decoded view, or as a view of that
    # view: each keeps the memory out of reuse.
    view = compression.decode(again)["w"][1:]
    third, _ = pool.take(0, LIKE)
    assert third is not again
    del again
    fourth, _ = pool.take(0, LIKE)
    assert any(np.shares_memory(view, e.tensors["w"][1]) for e in pool._pool[0])  # watched...
    assert not any(np.shares_memory(view, t[1]) for t in fourth.tensors.values())  # ...unused
    assert pool.take(1, LIKE)[0] is not fourth  # fragments have their own pools
    # Held through its dict of tensors, or through one (shape, array, scales) entry.
    tensors, entry = fourth.tensors, third.tensors["b"]
    del fourth, third, view
    gc.collect()
    for _ in range(3):
        enc, _ = pool.take(0, LIKE)
        assert enc.tensors is not tensors and enc.tensors["b"] is not entry


def test_at_most_spares_free_replies_stay_and_shapes_must_match():
    pool = ReplyBuffers(spares=1)
    held = [pool.take(0, LIKE)[0] for _ in range(5)]  # all held: five fresh replies
    alive = [weakref.ref(e) for e in held]
    assert pool.fresh == 5
    del held
    gc.collect()
    enc, _ = pool.take(0, LIKE)  # reuses one; of the others at most one spare stays
    assert pool.reused == 1 and sum(r() is not None for r in alive) <= 2
    assert any(e is enc for e in pool._pool[0])
    other = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.float32)}
    del enc
    enc, _ = pool.take(0, other)  # same sizes, other shape: not a match
    assert enc.tensors["w"][0] == (4, 3) and pool.reused == 1
    off = ReplyBuffers(spares=0)  # reuse off: new memory every time, nothing kept
    off.take(0, LIKE)
    off.take(0, LIKE)
    assert (off.fresh, off.reused) == (2, 0) and not off._pool[0]
    with pytest.raises(ValueError, match="spares"):
        ReplyBuffers(spares=-1)


def test_scratch_and_copy():
    scratch = chunks.Scratch()
    a = scratch.array((4, 8))
    b = scratch.array((3,))
    assert np.shares_memory(a, b) and a.dtype == np.float32 and b.flags.c_contiguous
    big = scratch.array((100,))
    assert big.size == 100
    dst = np.empty(100, np.float32)
    src = np.arange(100, dtype=np.float32).reshape(10, 10)
    chunks.copy(src, dst, threads=3)
    np.testing.assert_array_equal(dst, src.reshape(-1))
    with pytest.raises(ValueError, match="copy of 100 values into 99"):
        chunks.copy(src, np.empty(99, np.float32))


def _syncer(theta: dict, learners: int) -> Syncer:
    plan = make_fragment_plan({k: v.shape for k, v in theta.items()}, 1)
    cfg = DilocoConfig(learners=learners, sync_every=1, quorum=learners, merge="rda")
    syncer = Syncer(cfg, plan, theta)
    for m in range(learners):
        syncer.register(m, 0, True, 0.0, 1 << 40)
    return syncer


def test_replies_held_by_receivers_never_change_and_free_ones_are_reused():
    """Receivers keep some replies (the message, a decoded view) for several merges while
    others are dropped at once: every reply still reads as Θ at its version."""
    rng = np.random.default_rng(0)
    shapes = {"w": (64, 48), "b": (48,)}
    theta = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    syncer = _syncer(theta, learners=2)
    held = []
    for step in range(1, 13):
        for m in range(2):
            v = {k: 1e-2 * rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
            payload = compression.encode(v, "none")
            fields = dict(step=step, c_steps=1, c_tokens=64, time=0.0, nbytes=payload.nbytes())
            offer = Offer(m, 0, 0, base_version=syncer.version[0], payload=payload, **fields)
            sent = syncer.handle(offer, float(step))  # merges once every learner offered
        assert sent and syncer.version[0] == step
        reply = sent[0][1]
        want = {k: x.copy() for k, x in syncer.theta[0].items()}
        got = compression.decode(reply.payload)
        for k in shapes:
            np.testing.assert_array_equal(got[k], want[k])
        if step % 3 == 0:
            held.append((reply, want))  # the message stays queued
        elif step % 3 == 1:
            held.append((got, want))  # a learner's zero-copy anchor
        del sent, reply, got
    for kept, want in held:
        arrays = compression.decode(kept.payload) if hasattr(kept, "payload") else kept
        for k in shapes:
            np.testing.assert_array_equal(arrays[k], want[k])
    assert syncer.replies.reused >= 3  # the replies nobody kept were reused
