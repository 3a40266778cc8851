"""Data-parallel baseline at the token budget of configs/tiny_decoupled.py.

  python -m decoupled_diloco.main --config=configs/tiny_dense_4x.py --workdir=/tmp/dd_dense_4x

One learner over all 8 devices with 4x the per-learner batch (128 = 4 learners x 32) for
the same 300 steps: 300 x 128 x 128 = 4.9M tokens, exactly what the 4 learners of
tiny_decoupled / tiny_diloco / tiny_streaming consume together. Equal tokens at equal
steps keeps the learning-rate schedule (warmup, cosine) identical; the peak lr is the
per-learner one, unscaled for the 4x batch (a choice, not a tuned value).
"""

from decoupled_diloco.config import tiny_cpu_config


def get_config(arg=None):
    del arg
    return tiny_cpu_config("tiny_dense_4x", batch_size=128)  # sequences per step: 4 x 32
