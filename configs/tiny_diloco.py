"""DiLoCo baseline at CPU scale: 4 learners x 2 devices, one fragment, everyone waits.

  python -m decoupled_diloco.main --config=configs/tiny_diloco.py --workdir=/tmp/dd_diloco

DiLoCo as a configuration of the Decoupled code path (design.md §2): P = 1, K = M = 4,
tau = 0, learners wait for every merge (max_wait = -1), no grace, uniform weights, plain
mean; outer step lr 1, no momentum (`tiny_cpu_config`). Model, data, per-learner
batch, steps and H are those of configs/tiny_decoupled.py, so all see the same tokens.
"""

from decoupled_diloco.config import tiny_cpu_config


def get_config(arg=None):
    del arg
    c = tiny_cpu_config("tiny_diloco", learners=4)
    c.diloco.fragments = 1  # P: the whole model is one fragment
    c.diloco.overlap = 0  # tau: the merge is applied at the step it was offered
    # K = M, whatever M is set to (+ 0: a value derived from learners, not the same
    # one: a quorum set alone leaves learners as they are)
    c.diloco.quorum = c.diloco.get_ref("learners") + 0
    c.diloco.grace_gamma = 0.0  # no grace window (K = M already waits for all)
    c.diloco.max_wait = -1.0  # wait forever: synchronous
    c.diloco.weights = "uniform"
    c.diloco.merge = "mean"
    c.diloco.embedding_merge = "mean"
    return c
