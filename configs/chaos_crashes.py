"""Frequent crashes at CPU scale: Decoupled DiLoCo (M = 4, K = 1) vs data-parallel (DP).

  python -m decoupled_diloco.main --config=configs/chaos_crashes.py --workdir=/tmp/dd_chaos
  python -m decoupled_diloco.main --config=configs/chaos_crashes.py:dp --workdir=/tmp/dd_chaos_dp
  python experiments/chaos_crashes.py   # both side by side: table + plot (~9 min)

arg: "decoupled" (default) or "dp". Both arms run on the same 8 fake CPU devices, see the
same tokens per step (DP: one learner, 4x the batch) and the same chip failures: 64 chips
of 20 min MTBF each (one failure every ~19 s of wall time somewhere). Decoupled DiLoCo
splits the chips into 4 learners of 16, so a failure takes out one learner for
`restart_delay_s`, which then rejoins from the syncer's global parameters; the other
three keep training and merging (K = 1). DP is one job of 64 chips: every failure stops
it until the chip's slice is back, and it restarts from its last checkpoint
(`train.checkpoint_every`), redoing the steps since. Because the failure process has
the same rate in both arms, the seeded schedule gives both the same crash times.
"""

from decoupled_diloco.config import set_decoupled, tiny_cpu_config

LEARNERS = 4
CHIPS_PER_LEARNER = 16


def get_config(arg="decoupled"):
    if arg not in ("decoupled", "dp"):
        raise ValueError(f"configs/chaos_crashes.py:<arg> must be 'decoupled' or 'dp', got {arg!r}")
    dp = arg == "dp"
    # Per learner batch 16; DP: one job over the same devices with 4x the batch.
    c = tiny_cpu_config(
        f"chaos_crashes_{arg}", learners=1 if dp else LEARNERS, batch_size=64 if dp else 16
    )
    c.train.eval_every = 25  # steps: enough points for the loss-vs-wall-time plot
    c.train.eval_batches = 4
    c.train.checkpoint_every = 50  # steps: what a crashed DP job falls back to

    c.faults.seed = 0
    c.faults.chip_mtbf_hours = 1 / 3  # per chip: 20 min, so 64 chips fail every ~19 s
    c.faults.chips_per_learner = CHIPS_PER_LEARNER
    c.faults.restart_delay_s = 6.0  # failure -> failed part back (rejoin / relaunch)
    if dp:
        c.faults.chips_per_learner = LEARNERS * CHIPS_PER_LEARNER  # same chips, one job
        return c
    return set_decoupled(c)  # K = 1: merges never wait for a dead learner
