"""Training data: corpora, tokenizers and deterministic, resumable, sharded batch iterators.

it = make_iterator(DataConfig(), "train", batch_size=32, shard_index=m, num_shards=M)
batch_BT1 = next(it)          # int32 [B, seq_len + 1]; inputs [:, :-1], targets [:, 1:]
state = it.get_state()        # small JSON-serialisable dict; it.set_state(state) resumes
"""

from decoupled_diloco.data.config import DataConfig, validate_data_config
from decoupled_diloco.data.corpus import Corpus, load_corpus
from decoupled_diloco.data.iterator import TokenBatchIterator
from decoupled_diloco.data.pipeline import get_tokenizer, make_iterator, vocab_size
from decoupled_diloco.data.tokenizer import (
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
)

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataConfig",
    "SentencePieceTokenizer",
    "TokenBatchIterator",
    "Tokenizer",
    "build_tokenizer",
    "get_tokenizer",
    "load_corpus",
    "make_iterator",
    "validate_data_config",
    "vocab_size",
]
