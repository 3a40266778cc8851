"""Data-parallel baseline: one learner, the tiny Gemma-style model, Python stdlib corpus.

The README's first command; about a minute on 2 CPU cores:
  python -m decoupled_diloco.main --config=configs/tiny_dense.py --workdir=/tmp/dd_tiny
"""

from decoupled_diloco.config import tiny_cpu_config


def get_config(arg=None):
    del arg
    return tiny_cpu_config("tiny_dense")
