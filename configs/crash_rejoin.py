"""Each of 4 learners crashes once at a fixed step and rejoins from Θ with a fresh AdamW
state (tiny_decoupled otherwise: 300 steps, K = 1): the A/B of `train.fresh_warmup_steps`.

  python -m decoupled_diloco.main --config=configs/crash_rejoin.py:0 --workdir=/tmp/dd_cr0
  python -m decoupled_diloco.main --config=configs/crash_rejoin.py:-1 --workdir=/tmp/dd_cr1

arg: train.fresh_warmup_steps (0: off, the default; -1: train.warmup_steps, 30 here). The
crashes are in the learners' own steps (faults.unit = "steps"), so both arms lose the same
work; each learner is back 3 s after its crash. Result: experiments/README.md, section 10.
"""

from decoupled_diloco.config import set_decoupled, tiny_cpu_config

CRASHES = ((0, 60), (1, 120), (2, 180), (3, 240))  # (learner, its step)


def get_config(arg="0"):
    try:
        fresh_warmup = int(arg)
    except ValueError:
        raise ValueError(f"configs/crash_rejoin.py:<arg> must be an integer, got {arg!r}") from None
    c = set_decoupled(tiny_cpu_config(f"crash_rejoin_fw{fresh_warmup}", learners=4))
    c.faults.unit = "steps"
    c.faults.crashes = CRASHES
    c.faults.restart_delay_s = 3.0
    c.train.fresh_warmup_steps = fresh_warmup
    return c
