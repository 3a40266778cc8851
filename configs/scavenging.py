"""Scavenging: 4 learners all the time, 4 more while spare capacity is available.

  python -m decoupled_diloco.main --config=configs/scavenging.py --workdir=/tmp/dd_scavenge

Learners 0-3 are members for the whole run; learners 4-7 join at 20 s of wall time and
are preempted at 60 s (`faults.membership`). A joining learner starts from the syncer's
global parameters; a departing one makes its final offers and leaves cleanly, so with
K = 1 the global model never waits for capacity that comes and goes. Learners that have
not finished their steps when they leave do not come back. Each learner is one fake CPU
device (8 in all). About 2-3 minutes on 2 cores.
"""

from decoupled_diloco.config import set_decoupled, tiny_cpu_config

BASE, EXTRA = 4, 4
JOIN_S, LEAVE_S = 20.0, 60.0  # seconds of wall time


def get_config(arg=None):
    del arg
    # train.steps is per learner; the extra learners leave before reaching it.
    c = tiny_cpu_config("scavenging", learners=BASE + EXTRA, batch_size=8)
    c.train.eval_every = 50
    c.devices_per_learner = 1  # M counts every learner that may ever be present
    set_decoupled(c)
    c.faults.membership = [(m, JOIN_S, LEAVE_S) for m in range(BASE, BASE + EXTRA)]
    return c
