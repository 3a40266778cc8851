"""Decoupled DiLoCo with the tiny MoE model: 4 learners x 2 fake CPU devices, K=1, grace, RDA.

  python -m decoupled_diloco.main --config=configs/tiny_moe_decoupled.py --workdir=/tmp/dd_moe_dec

The settings of configs/tiny_decoupled.py with the tiny_moe preset (4 experts, top-2, every
layer). Router and expert weights are ordinary leaves: the balanced fragment plan packs them
like any other tensor, while each learner balances expert load on its own data between merges
(metrics.jsonl rows carry expert_load and dropped_fraction). Add --config.mesh.expert=2 to
shard each learner's experts over its 2 devices.
"""

from decoupled_diloco.config import set_decoupled, tiny_cpu_config


def get_config(arg=None):
    del arg
    return set_decoupled(tiny_cpu_config("tiny_moe_decoupled", preset="tiny_moe", learners=4))
