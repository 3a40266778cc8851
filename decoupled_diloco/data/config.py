"""Data configuration: which corpus, which tokenizer, how it is cut into training windows."""

import dataclasses

SOURCES = ("stdlib", "shakespeare", "path", "tfds")
TOKENIZERS = ("byte", "sentencepiece")
# 256 byte-fallback pieces + <unk> + <eos> + "\n" + at least one more: the floor for any
# corpus. Training needs one more piece per distinct character (those covering 99.95% of
# the text: dozens for English, thousands for CJK), which only the corpus tells; training
# names the number when data.spm_vocab_size is below it.
MIN_SPM_VOCAB_SIZE = 260
# T5's public sentencepiece model: 32,000 pieces trained on Common Crawl / C4 (Raffel et al.
# 2020, arXiv 1910.10683), in a public bucket every Google Cloud VM can read. The TPU configs'
# default tokenizer, for their C4 corpus.
T5_C4_SPM_MODEL = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"
# Pieces of published models, so a config naming one validates (model.vocab_size against the
# tokenizer) without reading it, e.g. offline; reading the file checks the number.
KNOWN_SPM_PIECES = {T5_C4_SPM_MODEL: 32_000}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. Frozen, hence hashable: the in-process corpus cache keys on it."""

    # "stdlib" | "shakespeare" | "path" | "tfds"; "" = "path" when `path` is set, else "stdlib"
    source: str = ""
    path: str = ""  # source="path": a text file, a folder (all text files below, sorted), or a glob
    tfds_name: str = ""  # source="tfds", e.g. "lm1b" or "c4/en:3.1.0"
    tfds_split: str = "train"  # TFDS split (slicing such as "train[:10%]" works) for training
    # "" -> hold out the last eval_fraction of the train records; else a split (or slice)
    # sharing no record with tfds_split (checked when the corpus opens)
    tfds_eval_split: str = ""
    tfds_data_dir: str = ""  # TFDS data_dir on TPU hosts ("" -> TFDS default)
    tfds_text_key: str = "text"  # feature holding the document text
    tokenizer: str = "byte"  # "byte" (vocab 256) | "sentencepiece"
    spm_vocab_size: int = 4096  # pieces, when training a sentencepiece BPE model locally
    # A pre-trained sentencepiece .model file, local or gs://; "" -> train one on the corpus
    # (cached in cache_dir; a Ray run trains it once, on the driver, and shares it with every
    # host through ray.checkpoint_dir). The run saves it as <workdir>/tokenizer.model.
    spm_model_path: str = ""
    cache_dir: str = ""  # trained tokenizers, local or gs://; "" -> ~/.cache/decoupled_diloco
    max_corpus_bytes: int = 0  # 0 = all; else keep only the first bytes (fast tests)
    eval_fraction: float = 0.02  # held-out fraction of documents (of characters if only one)
    seq_len: int = 128  # tokens per training example (windows hold seq_len + 1 tokens)
    seed: int = 0  # seeds the per-epoch shuffle of training windows / records (a run's
    # config passes its top-level `seed` unless data.seed is set: decoupled_diloco/config.py)

    def __post_init__(self):
        # A path or a TFDS name names a corpus: given without a source it selects its source
        # (the path first); what names a corpus is never silently ignored: with another
        # source it is an error (validate_data_config), as is a tokenizer file with bytes.
        if self.source == "":
            source = "path" if self.path else "tfds" if self.tfds_name else "stdlib"
            object.__setattr__(self, "source", source)


# (field, the key that selects what reads it, that reader, how to mend a conflict)
_ALONE = "drop one of the two (data.{} alone selects the {} source)"
_READ_ONLY_WITH = (
    ("path", "source", "path", _ALONE.format("path", "path")),
    *((f, "source", "tfds", _ALONE.format("tfds_name", "tfds"))
      for f in ("tfds_name", "tfds_eval_split", "tfds_data_dir")),
    ("spm_model_path", "tokenizer", "sentencepiece", "set it, or drop the model file"),
)  # fmt: skip


def unread_fields(cfg: DataConfig) -> list[tuple[str, str]]:
    """(field, why) of the fields set that cfg's source or tokenizer never reads: each is
    read under one source or tokenizer only. (tfds_split and tfds_text_key have defaults:
    only the fields left empty by default tell.)"""
    out = []
    for field, key, reader, fix in _READ_ONLY_WITH:
        chosen = getattr(cfg, key)
        if getattr(cfg, field) and chosen != reader:
            why = f"only read with data.{key}={reader!r}, but data.{key} is {chosen!r}: {fix}"
            out.append((field, why))
    return out


def _fail(field: str, value, why: str) -> ValueError:
    return ValueError(f"data.{field}={value!r}: {why}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_data_config(cfg: DataConfig) -> None:
    """Raises ValueError naming the offending `data.<field>`; touches no files."""
    if cfg.source not in SOURCES:
        raise _fail("source", cfg.source, f"unknown source; choose one of {SOURCES}")
    if cfg.source == "path" and not cfg.path:
        raise _fail("path", cfg.path, "source='path' needs a file, folder or glob")
    if cfg.source == "tfds":
        if not cfg.tfds_name:
            raise _fail("tfds_name", cfg.tfds_name, "source='tfds' needs a dataset name")
        if not cfg.tfds_split:
            raise _fail("tfds_split", cfg.tfds_split, "source='tfds' needs a train split")
        if not cfg.tfds_text_key:
            raise _fail("tfds_text_key", cfg.tfds_text_key, "must name the text feature")
        if cfg.tfds_eval_split and cfg.tfds_eval_split == cfg.tfds_split:
            raise _fail("tfds_eval_split", cfg.tfds_eval_split, "must differ from tfds_split")
    if cfg.tokenizer not in TOKENIZERS:
        raise _fail("tokenizer", cfg.tokenizer, f"unknown tokenizer; choose one of {TOKENIZERS}")
    # What names a corpus or a tokenizer file is never silently ignored.
    for field, why in unread_fields(cfg):
        raise _fail(field, getattr(cfg, field), why)
    trains_spm = cfg.tokenizer == "sentencepiece" and not cfg.spm_model_path
    if trains_spm and (not _is_int(cfg.spm_vocab_size) or cfg.spm_vocab_size < MIN_SPM_VOCAB_SIZE):
        raise _fail(
            "spm_vocab_size",
            cfg.spm_vocab_size,
            f"must be an int >= {MIN_SPM_VOCAB_SIZE} (256 byte pieces + specials + merges)",
        )
    if not _is_int(cfg.max_corpus_bytes) or cfg.max_corpus_bytes < 0:
        raise _fail("max_corpus_bytes", cfg.max_corpus_bytes, "must be an int >= 0 (0 = all)")
    if not isinstance(cfg.eval_fraction, int | float) or not 0.0 < cfg.eval_fraction < 1.0:
        raise _fail("eval_fraction", cfg.eval_fraction, "must be in the open interval (0, 1)")
    if not _is_int(cfg.seq_len) or cfg.seq_len < 1:
        raise _fail("seq_len", cfg.seq_len, "must be an int >= 1")
    if not _is_int(cfg.seed) or not 0 <= cfg.seed < 2**63:
        raise _fail("seed", cfg.seed, "must be an int in [0, 2**63)")
