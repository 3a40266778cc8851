"""Trains a config's sentencepiece model once and writes it where every host can read it.

    python -m decoupled_diloco.tokenizer --config=configs/tpu_dense_multislice.py \\
        --config.data.tfds_data_dir=gs://BUCKET/tensorflow_datasets \\
        --config.data.spm_model_path= --out=gs://BUCKET/tokenizers/bpe32k.model

(the TPU configs name T5's published model: the empty `spm_model_path` asks for a new one),
then run with `--config.data.spm_model_path=gs://BUCKET/tokenizers/bpe32k.model`. The model
is the one a run of that config would train (`data.spm_vocab_size` pieces on the first
16 MiB of its training split, decoupled_diloco/data/corpus.py); `--out` may be local or gs://.
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from decoupled_diloco import cli


def train_and_save(data_cfg, out: str) -> int:
    """Trains (or takes from the cache) `data_cfg`'s sentencepiece model and writes it to
    `out`; returns its vocabulary size."""
    from decoupled_diloco import paths
    from decoupled_diloco.data import SentencePieceTokenizer, get_tokenizer

    if data_cfg.tokenizer != "sentencepiece":
        raise ValueError(f"data.tokenizer={data_cfg.tokenizer!r}: only sentencepiece is trained")
    tokenizer = get_tokenizer(data_cfg)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    target = paths.resolve(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    paths.write_atomic(target, tokenizer.model_proto)
    return tokenizer.vocab_size


def check_out(out: str) -> None:
    """A ValueError naming --out when the model could not be written there, before the
    training it would end: a folder, or a local path under a file. Missing folders are
    created (a bucket has none to make)."""
    from decoupled_diloco import paths

    paths.check_reachable(out, "--out")
    if out.endswith("/") or paths.resolve(out).is_dir():
        raise ValueError(f"--out={out} is a folder: give the .model file's path, e.g. "
                         f"--out={out.rstrip('/')}/spm.model")  # fmt: skip
    if paths.is_remote(out):
        return
    parent = paths.resolve(out).parent
    while not parent.exists():  # the nearest folder that is there
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out={out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out={out}: {parent} is not writable")


def main(argv) -> None:
    cli.refuse_stray_arguments(argv)
    if not flags.FLAGS.config or not flags.FLAGS.out:
        sys.exit("usage: python -m decoupled_diloco.tokenizer --config=FILE --out=PATH.model")
    from decoupled_diloco import config as config_lib

    try:
        check_out(flags.FLAGS.out)
        data = config_lib.data_config(flags.FLAGS.config)
        if data.spm_model_path:
            raise ValueError("data.spm_model_path is set: that model exists already")
        vocab = train_and_save(data, flags.FLAGS.out)
    except (ValueError, ImportError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {flags.FLAGS.out} ({vocab} pieces)", flush=True)


def _define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "The run config whose corpus to train on.")
    flags.DEFINE_string("out", None, "Where to write the .model file (local or gs://).")


if __name__ == "__main__":
    cli.run(main, _define_flags)
