"""Data-parallel baseline of the tiny mixture-of-experts model (4 experts, top-2, every layer).

Same budget as configs/tiny_dense.py (one learner, batch 32 x 128 tokens, 300 steps) at about
the same activated parameters, so the two compare at equal tokens:
  python -m decoupled_diloco.main --config=configs/tiny_moe.py --workdir=/tmp/dd_moe
Shard experts across the learner's devices with --config.mesh.expert=2 (or 4, 8).
"""

from decoupled_diloco.config import default_config


def get_config(arg=None):
    del arg
    c = default_config()
    c.name = "tiny_moe"
    c.model.preset = "tiny_moe"
    c.data.source = "stdlib"
    c.data.seq_len = 128
    c.train.steps = 300
    c.train.batch_size = 32
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 30
    c.train.eval_every = 100
    c.diloco.learners = 1
    c.diloco.sync_every = 0  # no syncer: plain data-parallel training over all devices
    return c
