"""Entry points: a batch iterator for (split, shard), and the vocabulary size of a config."""

import numpy as np

from decoupled_diloco.data.config import DataConfig, validate_data_config
from decoupled_diloco.data.corpus import load_corpus
from decoupled_diloco.data.iterator import TokenBatchIterator
from decoupled_diloco.data.tokenizer import Tokenizer, load_sentencepiece
from decoupled_diloco.data.windows import PackedWindows, RecordWindows

SPLITS = ("train", "eval")
# Eval windows are visited in a fixed pseudo-random order, independent of data.seed, so a fixed
# number of eval batches samples the whole held-out set and runs with different seeds are
# evaluated on the same tokens.
EVAL_SEED = 0


def make_iterator(
    cfg: DataConfig, split: str, batch_size: int, shard_index: int = 0, num_shards: int = 1
) -> TokenBatchIterator:
    """Batches int32 [batch_size, seq_len + 1] of shard `shard_index` of `num_shards`.

    Shards read disjoint windows (learner m reads shard m); shard 0 of 1 reads everything.
    The corpus is loaded once per process, so a fresh iterator (e.g. for each evaluation)
    is cheap.
    """
    validate_data_config(cfg)
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: choose one of {SPLITS}")
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index={shard_index} must lie in [0, num_shards={num_shards})")
    corpus = load_corpus(cfg)
    data = corpus.splits[split]
    seed = cfg.seed if split == "train" else EVAL_SEED
    if isinstance(data, np.ndarray):
        stream = PackedWindows(data, cfg.seq_len, shard_index, num_shards, seed)
    else:
        tokenizer, records = corpus.tokenizer, data
        eos = np.array([tokenizer.eos_id], np.int32)

        def read_tokens(i: int) -> np.ndarray:
            return np.concatenate([tokenizer.encode(records.text(i)), eos])

        stream = RecordWindows(
            read_tokens, len(records), cfg.seq_len, shard_index, num_shards, seed
        )
    return TokenBatchIterator(stream, batch_size, split, shard_index, num_shards)


def get_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer of `cfg`'s corpus (cached with the corpus), e.g. to decode samples."""
    return load_corpus(cfg).tokenizer


def vocab_size(cfg: DataConfig) -> int:
    """Vocabulary size of `cfg`'s tokenizer, without loading the corpus when avoidable."""
    validate_data_config(cfg)
    if cfg.tokenizer == "byte":
        return 256
    if cfg.spm_model_path:
        return load_sentencepiece(cfg.spm_model_path).vocab_size
    # Trained locally with a hard vocabulary limit: exactly this size, or training fails.
    return cfg.spm_vocab_size
