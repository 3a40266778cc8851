"""Decoupled DiLoCo on Cloud TPU v5p with a mixture-of-experts model, one learner per slice.

moe_2p8b_active: the gemma_2b backbone with every FFW an MoE of 16 experts, top-2; with the 32k
vocabulary below, 2.3e9 activated and 15.2e9 total params. Within a slice the experts are split
over an 8-way expert axis and everything else FSDP over the rest. fp32 params + AdamW moments +
grads of 15.2e9 params are ~245 GB, so a v5p-32 slice (16 chips x 95 GB HBM, mesh fsdp 2 x
expert 8) leaves most HBM to activations; v5p-16 (8 chips, fsdp 1 x expert 8) is the smallest
slice this mesh fits on. The syncer's fp32 Θ and outer momentum need ~125 GB of head-VM RAM.
XLA:TPU (compile-only, scripts/tpu/README.md) puts the step at 77.8 GiB per chip on v5p-32
at the batch of 64 below: it fits; nothing has run on TPU.

  python scripts/tpu/launch.py launch --project=P --zone=us-east5-a \
      --accelerator=v5p-32 --slices=4 --config=configs/tpu_moe_v5p.py \
      --checkpoint-dir=gs://BUCKET/checkpoints/moe1 -- \
      --config.data.tfds_data_dir=gs://BUCKET/tensorflow_datasets

Same algorithm settings, data and Ray settings (TPU learners, evaluation on learner 0's slice,
unlimited restarts, a shared checkpoint dir) as configs/tpu_dense_multislice.py (P = 24, H = 24,
tau = 2, K = 1). Sizes are a starting point, not tuned or measured on TPU.
"""

from decoupled_diloco.config import default_config
from decoupled_diloco.data.config import T5_C4_SPM_MODEL


def get_config(arg=None):
    del arg
    c = default_config()
    c.name = "tpu_moe_v5p"
    c.runtime = "ray"  # one learner actor per slice, the syncer on the CPU head VM
    c.ray.accelerator = "tpu"  # each learner on its slice's TPU chips (the launcher sets it too)
    # Spot slices are preempted again and again over a long run, and every preemption costs a
    # learner process one restart: never give up on a learner (-1 = unlimited restarts).
    c.ray.max_restarts = -1
    # ...except one that raises the same error 3 times in a row without training past the step
    # of the last one (a missing package, a bad path): it is stopped and reported, and the
    # run goes on without it (runtime/ray/failures.py).
    c.ray.max_same_failures = 3
    # Θ is evaluated on learner 0's slice between two of its steps, not on the head VM's CPU.
    c.ray.evaluate = "learner"
    # Required: a path every VM reaches, e.g. gs://BUCKET/checkpoints/RUN (the launcher's
    # --checkpoint-dir passes --config.ray.checkpoint_dir).
    c.ray.checkpoint_dir = ""

    c.model.preset = "moe_2p8b_active"
    c.model.dtype = "bfloat16"  # compute dtype; params and optimizer state stay fp32
    c.model.vocab_size = 32_768  # >= the tokenizer's pieces (see configs/tpu_dense_multislice.py)

    c.data.source = "tfds"
    c.data.tfds_name = "c4/en:3.1.0"  # placeholder name: any TFDS text dataset in array_record
    c.data.tfds_split = "train"
    c.data.tfds_eval_split = "validation"
    c.data.tfds_data_dir = (
        ""  # set with --config.data.tfds_data_dir=gs://BUCKET/tensorflow_datasets
    )
    c.data.tfds_text_key = "text"
    c.data.tokenizer = "sentencepiece"
    # A pre-trained model, local or gs://, read by every host: T5's C4 model (32,000 pieces)
    # by default. Another: --config.data.spm_model_path=gs://BUCKET/tokenizers/bpe32k.model
    # (train one on your corpus with `python -m decoupled_diloco.tokenizer --config=<this
    # file> --config.data.spm_model_path= --out=gs://...`). Set to "", the driver trains one
    # of spm_vocab_size pieces on the corpus once and shares it through ray.checkpoint_dir.
    # The run saves the model it used as <workdir>/tokenizer.model.
    c.data.spm_model_path = T5_C4_SPM_MODEL
    c.data.spm_vocab_size = 32_768  # (pieces of a model trained on the corpus)
    c.data.seq_len = 2048

    c.train.steps = 50_000  # inner steps per learner
    c.train.batch_size = 64  # sequences per step per learner (divisible by the slice's chips)
    c.train.learning_rate = 4e-4
    c.train.warmup_steps = 1000
    c.train.weight_decay = 0.1
    c.train.eval_every = 1000
    c.train.eval_batches = 16
    c.train.log_every = 50
    c.train.checkpoint_every = 1000

    # Experts over an 8-way expert axis (16 experts: 2 per shard), the rest FSDP; v5p-N has
    # N/2 chips, so fsdp = chips / 8 (v5p-16 -> 1, v5p-32 -> 2, v5p-64 -> 4).
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.mesh.expert = 8
    c.devices_per_learner = 0  # the launcher passes the chips per slice

    c.diloco.learners = 4  # M, one per slice; the launcher passes --slices
    c.diloco.sync_every = 24  # H
    c.diloco.fragments = 24  # P
    c.diloco.fragment_strategy = "balanced"
    c.diloco.overlap = 2  # tau
    c.diloco.quorum = 1  # K
    c.diloco.grace_gamma = 0.5
    c.diloco.max_grace = 2.0  # seconds
    c.diloco.max_wait = 0.0
    # Learners land on each merge of their offer and send the steps since it with the next
    # offer (diloco/learner.py; experiments/results/apply_land/). Costs one more copy of the
    # parameters (float32, sharded like them) in each slice's memory; "rebase" does not.
    c.diloco.apply = "land"
    c.diloco.weights = "tokens"
    c.diloco.merge = "rda"
    c.diloco.embedding_merge = "mean"
    c.diloco.outer_lr = 0.7
    c.diloco.outer_momentum = 0.9
    # Learners take half of each merge's move (the rest goes back in their next offer): with
    # DiLoCo's outer (0.7, 0.9) and learners that never wait this removed most of what the
    # asynchrony cost (README, "How outer lr and momentum relate to M, K, P and H").
    c.diloco.alpha = 0.5
    c.diloco.heartbeat_timeout = 600.0  # first-step compilation of a 15.7e9-param MoE
    # Syncer checkpoints every 10 minutes (streamed one fragment at a time, off the serving
    # thread): a syncer crash rolls Θ back by at most the merges of the last 10 minutes.
    c.diloco.syncer_checkpoint_seconds = 600.0
    return c
