"""The learner's asynchronous pipeline: batches read ahead (data/prefetch.py) and merges
staged on the devices ahead of the boundary that applies them (runtime/boundary.py) change
when host work happens, never what the learner computes."""

import threading

import numpy as np
import pytest
from protocol_sim import Sim
from test_work_conservation import cfg

from decoupled_diloco.data import DataConfig, make_iterator
from decoupled_diloco.data.prefetch import Prefetch


def _iterator():
    return make_iterator(DataConfig(seq_len=16), "train", batch_size=4)


def test_prefetch_yields_the_plain_iterators_batches_and_state():
    plain, ahead = _iterator(), Prefetch(_iterator(), depth=3)
    for _ in range(7):
        np.testing.assert_array_equal(next(ahead), next(plain))
        # The consumer's position, however far ahead the reader thread is.
        assert ahead.get_state() == plain.get_state()
    ahead.close()


def test_prefetch_resumes_at_the_next_batch_after_set_state_and_close():
    plain, ahead = _iterator(), Prefetch(_iterator(), depth=4)
    for _ in range(3):
        next(ahead)
    saved = ahead.get_state()
    batches = [next(ahead) for _ in range(5)]
    ahead.set_state(saved)  # a resume from a checkpoint taken after 3 batches
    for b in batches:
        np.testing.assert_array_equal(next(ahead), b)
    ahead.close()  # rewinds the source to the consumer's position
    plain.set_state(ahead.get_state())
    np.testing.assert_array_equal(next(ahead), next(plain))
    ahead.close()


def test_prefetch_places_batches_on_its_own_thread():
    threads = []

    def put(batch):
        threads.append(threading.current_thread().name)
        return batch + 1

    plain, ahead = _iterator(), Prefetch(_iterator(), depth=2, put=put)
    np.testing.assert_array_equal(next(ahead), next(plain) + 1)
    assert threads and all(name == "prefetch" for name in threads)
    ahead.close()


class _Failing:
    """Three good batches, then an error."""

    batch_size = 1

    def __init__(self):
        self.i = 0

    def __next__(self):
        self.i += 1
        if self.i > 3:
            raise OSError("record 4 is corrupt")
        return np.full((1, 2), self.i)

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def test_prefetch_raises_a_readers_error_at_the_batch_it_belongs_to():
    ahead = Prefetch(_Failing(), depth=8)
    assert [int(next(ahead)[0, 0]) for _ in range(3)] == [1, 2, 3]
    with pytest.raises(OSError, match="record 4 is corrupt"):
        next(ahead)
    assert ahead.get_state() == {"i": 3}


def test_prefetch_rejects_a_depth_below_one():
    with pytest.raises(ValueError, match="depth"):
        Prefetch(_iterator(), depth=0)


def _final_state(sim: Sim) -> dict:
    out = {f"theta/{k}": v for k, v in sim.syncer.global_params().items()}
    for lr in sim.learners:
        out.update({f"{lr.proto.id}/{k}": v for k, v in lr.replica.host_params().items()})
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # rebase, τ = 1
        dict(overlap=0, compression="int8"),  # lossy offers: error feedback through v̂
        dict(apply="overwrite", overlap=2, alpha=0.5),
        dict(learners=4, quorum=2, alpha=0.25, outer_momentum=0.9, outer_lr=0.7),
    ],
)
def test_staged_merges_give_bit_identical_models(kw):
    """Every learner's θ and the syncer's Θ are bit-identical with merges staged ahead and
    computed at the boundary; most applied merges were staged."""
    runs = {}
    for stage in (False, True):
        sim = Sim(cfg(**kw), 30, up_delay=lambda m, msg: 1.5 * m,
                  down_delay=lambda m, msg: 0.7 + m, stage=stage)  # fmt: skip
        sim.run()
        runs[stage] = sim
    plain, staged = _final_state(runs[False]), _final_state(runs[True])
    for k in plain:
        np.testing.assert_array_equal(staged[k], plain[k], err_msg=k)
    hits = sum(lr.stager.hits for lr in runs[True].learners)
    misses = sum(lr.stager.misses for lr in runs[True].learners)
    assert hits > 0 and hits >= misses, (hits, misses)
