"""Data-parallel baseline of the tiny mixture-of-experts model (4 experts, top-2, every layer).

Same budget as configs/tiny_dense.py (one learner, batch 32 x 128 tokens, 300 steps) at about
the same activated parameters, so the two compare at equal tokens:
  python -m decoupled_diloco.main --config=configs/tiny_moe.py --workdir=/tmp/dd_moe
Shard experts across the learner's devices with --config.mesh.expert=2 (or 4, 8).
"""

from decoupled_diloco.config import tiny_cpu_config


def get_config(arg=None):
    del arg
    return tiny_cpu_config("tiny_moe", preset="tiny_moe")
