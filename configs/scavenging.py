"""Scavenging: 4 learners all the time, 4 more while spare capacity is available.

  python -m decoupled_diloco.main --config=configs/scavenging.py --workdir=/tmp/dd_scavenge

Learners 0-3 are members for the whole run; learners 4-7 join at 20 s of wall time and
are preempted at 60 s (`faults.membership`). A joining learner starts from the syncer's
global parameters; a departing one makes its final offers and leaves cleanly, so with
K = 1 the global model never waits for capacity that comes and goes. Learners that have
not finished their steps when they leave do not come back. Each learner is one fake CPU
device (8 in all). About 2-3 minutes on 2 cores.
"""

from decoupled_diloco.config import default_config

BASE, EXTRA = 4, 4
JOIN_S, LEAVE_S = 20.0, 60.0  # seconds of wall time


def get_config(arg=None):
    del arg
    c = default_config()
    c.name = "scavenging"
    c.model.preset = "tiny"
    c.data.source = "stdlib"
    c.data.seq_len = 128
    c.train.steps = 300  # per learner; the extra learners leave before reaching it
    c.train.batch_size = 8  # per learner
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 30
    c.train.eval_every = 50
    c.devices_per_learner = 1
    c.diloco.learners = BASE + EXTRA  # M counts every learner that may ever be present
    c.diloco.sync_every = 12  # H
    c.diloco.fragments = 6  # P
    c.diloco.overlap = 2  # tau
    c.diloco.quorum = 1  # K
    c.diloco.grace_gamma = 0.5
    c.diloco.max_grace = 1.0  # seconds
    c.faults.membership = [(m, JOIN_S, LEAVE_S) for m in range(BASE, BASE + EXTRA)]
    return c
