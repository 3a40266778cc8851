"""Loads a corpus once per process: its tokenizer and, per split, its tokens or records.

In-memory sources (stdlib, shakespeare, path) are tokenized whole into one packed array per
split; TFDS sources stay lazy (record ranges, tokenized as they are read).
"""

import dataclasses
import hashlib
import threading

import numpy as np

from decoupled_diloco.data import sources, tfds_source
from decoupled_diloco.data.config import DataConfig, validate_data_config
from decoupled_diloco.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

# Enough text for a 4k-32k BPE vocabulary; training on more costs time and little quality.
SPM_TRAINING_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Corpus:
    tokenizer: Tokenizer
    # Per split ("train", "eval"): packed ids [n] (documents each followed by eos; `id_dtype`:
    # uint8 for bytes, uint16 up to 65536 pieces) or a lazy TFDS record range.
    splits: dict[str, np.ndarray | tfds_source.RecordRange]
    # Per split, names of the documents it holds (in-memory sources only; empty for TFDS).
    document_names: dict[str, tuple[str, ...]]
    # Per split, what identifies its text (`fingerprint`): a resumed run compares it with the
    # record its first attempt left (run_files.check_corpus).
    fingerprint: dict[str, dict]


_CACHE: dict[DataConfig, Corpus] = {}
_LOCK = threading.Lock()  # learner threads may ask for the same corpus at once


def _corpus_key(cfg: DataConfig) -> DataConfig:
    # seq_len and seed change how a corpus is cut and shuffled, not the corpus.
    return dataclasses.replace(cfg, seq_len=1, seed=0)


def text_splits(cfg: DataConfig) -> dict[str, list[sources.Document]]:
    """{"train": docs, "eval": docs} of an in-memory source, held out by document."""
    docs = sources.read_documents(sources.corpus_files(cfg), cfg.max_corpus_bytes)
    if not docs:  # e.g. only empty .jsonl files
        where = f"data.path={cfg.path!r}" if cfg.path else f"data.source={cfg.source!r}"
        raise ValueError(f"{where}: its files hold no documents")
    train, eval_ = sources.hold_out(docs, cfg.eval_fraction)
    for split, held in (("train", train), ("eval", eval_)):
        if not any(d.text for d in held):  # windows of separators alone
            raise ValueError(
                f"the {split} split of {cfg.path or cfg.source or 'stdlib'} holds no text: its "
                f"{len(held)} document(s) are empty"
            )
    return {"train": train, "eval": eval_}


def _join_for_training(texts, max_bytes: int) -> str:
    parts, total = [], 0
    for text in texts:
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return "\n".join(parts)[:max_bytes]


def id_dtype(vocab_size: int) -> type:
    """The smallest dtype that holds every id: a packed corpus stays in memory for the run."""
    return np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.int32


def pack(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """Token ids of the texts, each followed by eos, concatenated: [n] (`id_dtype`)."""
    dtype = id_dtype(tokenizer.vocab_size)
    if isinstance(tokenizer, ByteTokenizer):  # the utf-8 bytes are the ids: no int32 copy

        def encode(text: str) -> np.ndarray:
            return np.frombuffer(text.encode("utf-8"), np.uint8)
    else:

        def encode(text: str) -> np.ndarray:
            return tokenizer.encode(text).astype(dtype)

    eos = np.array([tokenizer.eos_id], dtype)
    pieces = []
    for text in texts:
        pieces += [encode(text), eos]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype)


def fingerprint(docs: list[sources.Document]) -> dict:
    """What identifies a split of an in-memory source: its documents, their characters and a
    sha256 of their names and texts in order (any file added, removed, renamed or edited
    changes it; reading the same files on another machine does not)."""
    digest, characters = hashlib.sha256(), 0
    for doc in docs:
        for part in (doc.name, doc.text):
            data = part.encode("utf-8", "surrogatepass")  # (undecodable file names)
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
        characters += len(doc.text)
    return {"documents": len(docs), "characters": characters, "sha256": digest.hexdigest()}


def _load(cfg: DataConfig) -> Corpus:
    if cfg.source == "tfds":
        splits = tfds_source.open_tfds_splits(cfg)
        tokenizer = build_tokenizer(
            cfg, lambda: tfds_source.training_text(splits["train"], SPM_TRAINING_BYTES)
        )
        prints = {split: tfds_source.fingerprint(r) for split, r in splits.items()}
        return Corpus(tokenizer, splits, {"train": (), "eval": ()}, prints)
    docs = text_splits(cfg)
    tokenizer = build_tokenizer(
        cfg, lambda: _join_for_training((d.text for d in docs["train"]), SPM_TRAINING_BYTES)
    )
    return Corpus(
        tokenizer,
        {split: pack(tokenizer, [d.text for d in ds]) for split, ds in docs.items()},
        {split: tuple(d.name for d in ds) for split, ds in docs.items()},
        {split: fingerprint(ds) for split, ds in docs.items()},
    )


def load_corpus(cfg: DataConfig) -> Corpus:
    """The corpus of `cfg`, loaded on first use and cached for the life of the process."""
    validate_data_config(cfg)
    key = _corpus_key(cfg)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _load(key)
        return _CACHE[key]
