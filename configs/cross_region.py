"""Cross-region: 2 learners next to the syncer, 2 in a far region behind a slow link.

  python -m decoupled_diloco.main --config=configs/cross_region.py --workdir=/tmp/dd_xregion
  python -m decoupled_diloco.main --config=configs/cross_region.py \
      --config.diloco.compression=int4 --workdir=/tmp/dd_xregion_int4

Per-learner one-way latency and bandwidth to the syncer (`faults.link_latency_s`,
`faults.link_bandwidth_bps`) delay offers and merged fragments on the wire; with
max_wait = 0 they delay merges but never a learner's steps. A fragment of the tiny model
is ~100 kB in fp32, i.e. ~80 ms on the far learners' 10 Mbit/s; int4 compression cuts
that ~8x. About 2 minutes on 2 cores.
"""

from decoupled_diloco.config import set_decoupled, tiny_cpu_config

NEAR = (0.002, 1e9)  # (one-way latency s, bits/s): same region as the syncer
FAR = (0.15, 10e6)  # another region over a thin WAN share


def get_config(arg=None):
    del arg
    c = set_decoupled(tiny_cpu_config("cross_region", learners=4, batch_size=16))
    c.train.eval_every = 50
    c.diloco.compression = "none"  # try int4 for the far learners' sake
    links = (NEAR, NEAR, FAR, FAR)  # tau = 2 steps of slack hide the far links' latency
    c.faults.link_latency_s = [lat for lat, _ in links]
    c.faults.link_bandwidth_bps = [bw for _, bw in links]
    return c
