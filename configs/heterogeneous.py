"""Heterogeneous learners: 4 fast + 4 slow (18% slower, 10% per-step noise), 8 learners.

  python -m decoupled_diloco.main --config=configs/heterogeneous.py:sync --workdir=/tmp/dd_het_sync
  python -m decoupled_diloco.main --config=configs/heterogeneous.py:k1 --workdir=/tmp/dd_het_k1
  python -m decoupled_diloco.main --config=configs/heterogeneous.py:k1_grace \
      --workdir=/tmp/dd_het_grace

arg selects the quorum rule (the paper's heterogeneous experiment):
  sync      K = M = 8 and learners wait for every merge (max_wait = forever): everyone
            runs at the pace of the slowest learner; the waiting is lost goodput (paper 84%).
  k1        K = 1, no grace window, never wait: 100% goodput, smaller merges.
  k1_grace  K = 1 plus the adaptive grace window: 100% goodput, merges about as large
            as K = 8 (the paper: K = 8 quality).
Each learner is one fake CPU device; a few minutes per run on 2 cores.
"""

from decoupled_diloco.config import set_decoupled, tiny_cpu_config

LEARNERS = 8
MODES = ("sync", "k1", "k1_grace")


def get_config(arg="k1_grace"):
    if arg not in MODES:
        raise ValueError(f"configs/heterogeneous.py:<arg> must be one of {MODES}, got {arg!r}")
    c = tiny_cpu_config(f"heterogeneous_{arg}", learners=LEARNERS, batch_size=8, steps=240)
    c.train.eval_every = 40
    c.devices_per_learner = 1
    set_decoupled(c)

    c.faults.slow_fraction = 0.5  # the last 4 learners...
    c.faults.slow_factor = 1.18  # ...take 18% longer per step
    c.faults.speed_noise = 0.10  # log-normal per-step noise on every learner

    if arg == "sync":
        # K = M, whatever M is set to (+ 0: a value derived from learners, not the same
        # one: a quorum set alone leaves learners as they are)
        c.diloco.quorum = c.diloco.get_ref("learners") + 0
        c.diloco.grace_gamma = 0.0
        c.diloco.max_wait = -1.0  # wait at t + tau until the merge is there
    else:
        # The grace window spends the slack of the tau overlap steps on collecting offers.
        c.diloco.grace_gamma = 1.0 if arg == "k1_grace" else 0.0
    return c
