"""Streaming DiLoCo baseline at CPU scale: 4 learners x 2 devices, P fragments, K = M.

  python -m decoupled_diloco.main --config=configs/tiny_streaming.py --workdir=/tmp/dd_stream

Streaming DiLoCo as a configuration of the Decoupled code path (design.md §2, §4): the
fragments and H of configs/tiny_decoupled.py (P = 6 balanced; the tiny model has only 2
blocks, too few for Streaming's strided layer groups), quorum K = M with learners waiting
for every merge (max_wait = -1), no grace, uniform weights, plain mean, and Streaming
DiLoCo's tau = 1 and mixing alpha = 0.5 (outer step as below). Wire format fp32
(Streaming DiLoCo used 4-bit; `--config.diloco.compression=int4` for that).
"""

from decoupled_diloco.config import tiny_cpu_config


def get_config(arg=None):
    del arg
    c = tiny_cpu_config("tiny_streaming", learners=4)  # H = 12, P = 6 as tiny_decoupled
    c.diloco.overlap = 1  # tau (Streaming DiLoCo: 1)
    c.diloco.apply = "overwrite"  # Streaming DiLoCo's rule, with its mixing:
    c.diloco.alpha = 0.5  # theta <- 0.5 theta + 0.5 merged (Streaming DiLoCo)
    # K = M, whatever M is set to (+ 0: a value derived from learners, not the same
    # one: a quorum set alone leaves learners as they are)
    c.diloco.quorum = c.diloco.get_ref("learners") + 0
    c.diloco.grace_gamma = 0.0
    c.diloco.max_wait = -1.0  # wait forever: synchronous
    c.diloco.weights = "uniform"
    c.diloco.merge = "mean"
    c.diloco.embedding_merge = "mean"
    return c
