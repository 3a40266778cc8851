"""Decoupled DiLoCo on Cloud TPU: a Gemma-shaped dense model (2B, 5B or 9B), one learner per slice.

Size: `--config=configs/tpu_dense_multislice.py:5b` (or `:9b`); 2B by default. The batch and
memory notes below are for 2B; the larger shapes need proportionally larger slices.

Paper setting: P = 24 fragments, H = 24 (one fragment synced per step), tau = 2, K = 1, with the
adaptive grace window, token weights and RDA. Each learner shards the model FSDP-style over all
chips of its slice (bf16 compute, fp32 params); the syncer runs on the CPU head VM.
scripts/tpu/launch.py sets the learner count and chips per learner from the slices it created:

  python scripts/tpu/launch.py launch --project=P --zone=us-west4-a \
      --accelerator=v5litepod-32 --slices=4 --checkpoint-dir=gs://BUCKET/checkpoints/run1 -- \
      --config.data.tfds_data_dir=gs://BUCKET/tensorflow_datasets

which runs, on the head VM:

  python -m decoupled_diloco.main --config=configs/tpu_dense_multislice.py --workdir=runs/dd \
      --config.runtime=ray --config.ray.accelerator=tpu --config.diloco.learners=4 \
      --config.devices_per_learner=32 --config.ray.address=HEAD_IP:6379 \
      --config.ray.checkpoint_dir=gs://BUCKET/checkpoints/run1 \
      --config.data.tfds_data_dir=gs://BUCKET/tensorflow_datasets

Evaluation runs on learner 0's slice (`ray.evaluate = "learner"`, runtime/ray_eval.py);
learner processes restart without limit (Spot preemptions).

Data: TFDS "c4/en:3.1.0" read through tfds.data_source, which needs the array_record file
format (the public gs://tensorflow-datasets copy is TFRecord; see scripts/tpu/README.md).
Memory (XLA:TPU compile-only, scripts/tpu/README.md "Memory per chip"): the 2B step at the
batch of 64 below on v5litepod-32 (2 sequences per chip) needs 14.75 of 15.75 GiB per chip
without rematerialisation, 6.7 GiB with --config.model.remat=full. Run
scripts/tpu/memory_table.py before choosing another size or slice.
Sizes below (batch, steps, lr) are a starting point, not tuned on TPU.
"""

from decoupled_diloco.config import default_config
from decoupled_diloco.data.config import T5_C4_SPM_MODEL

# `--config=configs/tpu_dense_multislice.py:9b` picks the model size (default 2b).
SIZES = {"2b": "gemma_2b", "5b": "gemma_5b", "9b": "gemma_9b"}


def get_config(arg=None):
    size = arg or "2b"
    if size not in SIZES:
        raise ValueError(f"configs/tpu_dense_multislice.py: size {size!r} not in {sorted(SIZES)}")
    c = default_config()
    c.name = f"tpu_dense_multislice_{size}"
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

    c.model.preset = SIZES[size]  # gemma_2b: d 2304, 26 layers, 8 heads / 4 kv heads, ffw 9216
    c.model.dtype = "bfloat16"  # compute dtype; params and optimizer state stay fp32
    # A 32k vocabulary (T5's C4 sentencepiece model, below: 32,000 pieces, padded to a multiple
    # of 128 rows) instead of Gemma's 256k saves 0.5e9 embedding params that would never be
    # used. With the Gemma tokenizer instead, pass
    # --config.data.spm_model_path=/path/tokenizer.model --config.model.vocab_size=256128.
    c.model.vocab_size = 32_768

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
    c.data.seq_len = 2048  # tokens per example

    c.train.steps = 50_000  # inner steps per learner: 4 learners x 64 x 2048 x 50k = 26e9 tokens
    c.train.batch_size = 64  # sequences per step per learner (divisible by the slice's chips)
    c.train.learning_rate = 4e-4  # DiLoCo's inner AdamW lr
    c.train.warmup_steps = 1000
    c.train.weight_decay = 0.1
    c.train.eval_every = 1000
    c.train.eval_batches = 16
    c.train.log_every = 50
    c.train.checkpoint_every = 1000

    # Each learner's mesh covers its whole slice: FSDP over every chip.
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.mesh.expert = 1
    c.devices_per_learner = 0  # the launcher passes the chips per slice

    c.diloco.learners = 4  # M, one per slice; the launcher passes --slices
    c.diloco.sync_every = 24  # H
    c.diloco.fragments = 24  # P: one fragment due every H/P = 1 step
    c.diloco.fragment_strategy = "balanced"
    c.diloco.overlap = 2  # tau
    c.diloco.quorum = 1  # K
    c.diloco.grace_gamma = 0.5
    c.diloco.max_grace = 2.0  # seconds
    c.diloco.max_wait = 0.0  # learners never wait for the syncer
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
    # The first step compiles the 2B model for minutes; a learner must not be declared dead then.
    c.diloco.heartbeat_timeout = 600.0
    # Syncer checkpoints every 10 minutes (streamed one fragment at a time, off the serving
    # thread): a syncer crash rolls Θ back by at most the merges of the last 10 minutes.
    c.diloco.syncer_checkpoint_seconds = 600.0
    return c
