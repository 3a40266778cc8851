"""Decoupled DiLoCo at CPU scale: 4 learners x 2 fake CPU devices, K=1, grace, RDA, mixing,
outer lr 0.75 (`set_decoupled`).

  python -m decoupled_diloco.main --config=configs/tiny_decoupled.py --workdir=/tmp/dd_dec

Same per-learner model, batch and steps as the baselines in configs/tiny_{diloco,streaming}.py;
4 learners see 4x the tokens of configs/tiny_dense.py, so compare against
configs/tiny_dense_4x.py (one learner, 4x batch) at equal tokens.
"""

from decoupled_diloco.config import set_decoupled, tiny_cpu_config


def get_config(arg=None):
    del arg
    return set_decoupled(tiny_cpu_config("tiny_decoupled", learners=4))
