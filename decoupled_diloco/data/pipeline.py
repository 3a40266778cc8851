"""Entry points: a batch iterator for (split, shard), and the vocabulary size of a config."""

import numpy as np

from decoupled_diloco.data.config import KNOWN_SPM_PIECES, DataConfig, validate_data_config
from decoupled_diloco.data.corpus import load_corpus
from decoupled_diloco.data.iterator import TokenBatchIterator
from decoupled_diloco.data.tokenizer import Tokenizer, load_sentencepiece
from decoupled_diloco.data.windows import PackedWindows, RecordWindows

SPLITS = ("train", "eval")
# Eval windows are visited in a fixed pseudo-random order, independent of data.seed, so a fixed
# number of eval batches samples the whole held-out set and runs with different seeds are
# evaluated on the same tokens.
EVAL_SEED = 0


def rows_per_host(batch_size: int, num_hosts: int, name: str = "batch_size") -> int:
    """The rows of a batch each of a learner's hosts reads (its own); ValueError naming
    `name` unless the batch splits evenly over the hosts."""
    if batch_size % num_hosts:
        raise ValueError(
            f"{name}={batch_size} must be a multiple of the learner's {num_hosts} hosts "
            "(each host reads its own rows)"
        )
    return batch_size // num_hosts


def make_iterator(
    cfg: DataConfig,
    split: str,
    batch_size: int,
    shard_index: int = 0,
    num_shards: int = 1,
    host_index: int = 0,
    num_hosts: int = 1,
) -> TokenBatchIterator:
    """Batches int32 [batch_size / num_hosts, seq_len + 1]: host `host_index`'s rows of the
    global batches of shard `shard_index` of `num_shards`.

    Shards read disjoint windows (learner m reads shard m); shard 0 of 1 reads everything.
    A learner spanning several hosts splits its shard again, host h reading sub-shard
    shard_index·num_hosts + h of num_shards·num_hosts and only its own rows (the global
    batch is formed on device, transfer.batch_to_device); with one host this is shard m of
    M itself. The corpus is loaded once per process, so a fresh iterator (e.g. for each
    evaluation) is cheap.
    """
    validate_data_config(cfg)
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: choose one of {SPLITS}")
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index={shard_index} must lie in [0, num_shards={num_shards})")
    if num_hosts < 1 or not 0 <= host_index < num_hosts:
        raise ValueError(f"host_index={host_index} must lie in [0, num_hosts={num_hosts})")
    rows = rows_per_host(batch_size, num_hosts)
    corpus = load_corpus(cfg)
    data = corpus.splits[split]
    seed = cfg.seed if split == "train" else EVAL_SEED
    shard, shards = shard_index * num_hosts + host_index, num_shards * num_hosts
    remedies = ["a larger data.eval_fraction"] if split == "eval" else []
    if cfg.max_corpus_bytes:  # (what the errors raised if the split is too small advise)
        cap = cfg.max_corpus_bytes
        remedies.append(f"data.max_corpus_bytes=0 (all of it, not its first {cap} bytes)")
    remedy = " or ".join(remedies) or "more data"
    what = f"the {split} split of {cfg.path or cfg.tfds_name or cfg.source or 'stdlib'}"
    items = (len(data) - 1) // cfg.seq_len if isinstance(data, np.ndarray) else len(data)
    if 0 < items < shards:
        unit = (
            f"windows of data.seq_len={cfg.seq_len}" if isinstance(data, np.ndarray) else "records"
        )
        raise ValueError(
            f"{what} holds {items} {unit}, fewer than the {shards} readers that split it "
            f"({num_shards} learner(s) x {num_hosts} host(s)): use fewer learners or {remedy}"
        )
    if isinstance(data, np.ndarray):
        stream = PackedWindows(data, cfg.seq_len, shard, shards, seed, what, remedy)
    else:
        stream = record_windows(corpus.tokenizer, data, cfg.seq_len, shard, shards, seed)
    return TokenBatchIterator(stream, rows, split, shard_index, num_shards, host_index, num_hosts)


def record_windows(
    tokenizer: Tokenizer, records, seq_len: int, shard: int, shards: int, seed: int
) -> RecordWindows:
    """Windows of documents read a group at a time from `records` (tfds_source.RecordRange,
    or anything with `len` and `texts(indices) -> list[str]`)."""
    eos = np.array([tokenizer.eos_id], np.int32)

    def read_documents(indices: np.ndarray) -> list[np.ndarray]:
        texts = records.texts(indices)
        return [np.concatenate([tokenizer.encode(t), eos]).astype(np.int32) for t in texts]

    return RecordWindows(read_documents, len(records), seq_len, shard, shards, seed)


def get_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer of `cfg`'s corpus (cached with the corpus), e.g. to decode samples."""
    return load_corpus(cfg).tokenizer


def vocab_size(cfg: DataConfig) -> int:
    """Vocabulary size of `cfg`'s tokenizer, without loading the corpus when avoidable."""
    validate_data_config(cfg)
    if cfg.tokenizer == "byte":
        return 256
    if cfg.spm_model_path in KNOWN_SPM_PIECES:  # published: checked when it is loaded
        return KNOWN_SPM_PIECES[cfg.spm_model_path]
    if cfg.spm_model_path:
        return load_sentencepiece(cfg.spm_model_path).vocab_size
    # Trained locally with a hard vocabulary limit: exactly this size, or training fails.
    return cfg.spm_vocab_size
