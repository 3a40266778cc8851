"""Data-parallel baseline: one learner, the tiny Gemma-style model, Python stdlib corpus.

The README's first command; about a minute on 2 CPU cores:
  python -m decoupled_diloco.main --config=configs/tiny_dense.py --workdir=/tmp/dd_tiny
"""

from decoupled_diloco.config import default_config


def get_config(arg=None):
    del arg
    c = default_config()
    c.name = "tiny_dense"
    c.model.preset = "tiny"
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
