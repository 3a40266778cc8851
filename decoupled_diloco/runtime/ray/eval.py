"""Where a Ray run evaluates Θ (`ray.evaluate`), and the learner-side half of it.

- "driver" (default; CPU development): the driver fetches Θ from the syncer shards as numpy
  and evaluates it on its own devices, as the local runtime does. On Cloud TPU the driver
  is the head VM's CPU, far too slow for a multi-billion-parameter model.
- "learner" (the TPU configs): the lowest-numbered live learner evaluates Θ on its own
  devices (its slice). The driver asks the syncer shards for Θ without fetching it (object
  refs) and hands the refs to every process of that learner; Ray moves Θ to each of its
  hosts as numpy. The learner's thread evaluates between two train steps (every host of a
  multi-host slice at the same step boundary, agreed by a broadcast from host 0) and, once
  it has finished training, whenever asked. Its training pauses meanwhile (compiling the
  eval step on the first request, then `train.eval_batches` forward passes): that time is
  allocated but not useful in its goodput, and it needs room for a second copy of the
  parameters on its devices. Tested on CPU with single-process learners; the multi-host
  agreement needs a multi-host TPU slice and is untested here.
- "off": no evaluation during the run; `final_eval_loss` is NaN. Θ is in the syncer
  checkpoints under `ray.checkpoint_dir` for an evaluation afterwards.

Requests carry integer tags; results come back with the learner's `poll` ("evals").
"""

import threading

import numpy as np

FINAL_EVAL_TIMEOUT_S = 3600.0  # a large model compiles its eval step on the first request
_AGREE_WAIT_S = 60.0  # a multi-host learner's hosts wait this long for a request host 0 has


class LearnerEvals:
    """A learner process's evaluation requests: `put` from actor calls, `serve` from the
    learner's thread at step boundaries."""

    def __init__(self, host: int, hosts: int, make_evaluator, emit):
        self.host, self.hosts = host, hosts
        self._make_evaluator, self._emit = make_evaluator, emit
        self._evaluator = None
        self._requests: dict[int, dict] = {}  # tag -> Θ (flat name -> numpy)
        self._cv = threading.Condition()

    def put(self, tag: int, shards: tuple[dict, ...]) -> None:
        from decoupled_diloco.diloco.fragment_members import join_members

        theta: dict = {}
        for shard in shards:
            theta.update(shard)
        theta = join_members(theta)  # whole leaves from fragment members
        with self._cv:
            self._requests[tag] = theta
            self._cv.notify_all()

    def serve(self) -> None:
        """Evaluates at most one request; every host of a slice calls this at the same step
        boundaries (it issues a collective when the slice has several hosts)."""
        with self._cv:
            tag = min(self._requests, default=-1)
        if self.hosts > 1:  # the hosts agree on host 0's oldest request
            from jax.experimental import multihost_utils

            tag = int(multihost_utils.broadcast_one_to_all(np.int64(tag)))
        if tag < 0:
            return
        with self._cv:
            if not self._cv.wait_for(lambda: tag in self._requests, timeout=_AGREE_WAIT_S):
                raise RuntimeError(
                    f"evaluation request {tag} reached host 0 but not host {self.host} "
                    f"within {_AGREE_WAIT_S:.0f} s"
                )
            theta = self._requests.pop(tag)
        try:  # a failed evaluation (e.g. out of memory) must not take training down
            if self._evaluator is None:
                self._evaluator = self._make_evaluator()
            out = {"tag": tag, "eval_loss": self._evaluator(theta)}
        except Exception as e:
            out = {"tag": tag, "eval_loss": float("nan"), "error": f"{type(e).__name__}: {e}"}
        if self.host == 0:
            self._emit(out)


class DriverEvals:
    """The driver's side of `ray.evaluate = "learner"`: requests and their results."""

    def __init__(self):
        self._tag = 0
        self.pending: dict[int, dict] = {}  # tag -> the metrics row, without eval_loss yet
        self.results: dict[int, float] = {}  # tags of rows without a place in metrics.jsonl
        self.failed: set[int] = set()  # tags whose request did not reach every process
        self._calls: dict = {}  # in-flight `evaluate` call -> its tag

    def request(self, learner_handles: list, syncers: list, row: dict | None) -> int:
        """Asks every process of one learner to evaluate Θ; `row` is written when the
        result arrives (None: the caller waits for it, `results`)."""
        self.reap()
        self._tag += 1
        refs = [s.global_params.remote() for s in syncers]  # never fetched by the driver
        for h in learner_handles:
            self._calls[h.evaluate.remote(self._tag, *refs)] = self._tag
        if row is not None:
            self.pending[self._tag] = row
        return self._tag

    def result(self, out: dict) -> dict | None:
        """A learner's result: the completed metrics row, or None (kept in `results`)."""
        row = self.pending.pop(out["tag"], None)
        if row is None:
            self.results[out["tag"]] = out["eval_loss"]
            return None
        return {**row, "eval_loss": out["eval_loss"]}

    def reap(self) -> None:
        """Consumes finished calls: a learner down or restarting misses that evaluation."""
        import ray

        if not self._calls:
            return
        done, _ = ray.wait(list(self._calls), num_returns=len(self._calls), timeout=0)
        for ref in done:
            tag = self._calls.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                self.failed.add(tag)
