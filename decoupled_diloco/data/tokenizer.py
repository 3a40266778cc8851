"""Tokenizers: utf-8 bytes (vocab 256) or a sentencepiece BPE model, pre-trained (a .model
file, local or gs://) or trained on the corpus and cached.

The byte tokenizer and a model trained here round-trip text exactly; a pre-trained model
encodes and decodes as sentencepiece does (its normalizer may change whitespace or characters).
Each gives the id that separates documents (`eos_id`).
"""

import hashlib
import io
import re
from collections.abc import Callable
from typing import Protocol

import numpy as np
from absl import logging
from etils import epath

from decoupled_diloco import paths
from decoupled_diloco.data.config import KNOWN_SPM_PIECES, DataConfig

_SPM_INSTALL = "pip install sentencepiece"
# Bumped whenever the trainer options below change, so stale cached models are not reused.
_SPM_RECIPE = "bpe-identity-bytefallback-v2"
# sentencepiece trains on lines and drops longer ones from training (not from encoding):
# longer lines are cut into pieces of at most this many bytes (`_training_lines`).
_SPM_MAX_LINE_BYTES = 1 << 14
# Characters covering this share of the corpus get a piece each; rarer ones byte fallback.
_SPM_CHARACTER_COVERAGE = 0.9995
_SPM_FIXED_PIECES = 256 + 3  # byte pieces, <unk>, <eos>, "\n": the pieces before characters
_LINES_PER_CALL = 4096  # lines one encode call takes (`SentencePieceTokenizer.encode`)
_MARK = "\u2581"  # sentencepiece's whitespace mark ("▁")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int  # separates documents in the packed token stream

    def encode(self, text: str) -> np.ndarray:
        """Text -> int32 ids [n]."""
        ...

    def decode(self, ids) -> str:
        """Ids [n] -> text (the document separator decodes to nothing or to NUL)."""
        ...


class ByteTokenizer:
    """utf-8 bytes as ids. Byte 0 (NUL, absent from text) doubles as the document separator."""

    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError(
                f"byte tokenizer ids must lie in [0, 255], got {ids.min()}..{ids.max()}"
            )
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A sentencepiece model (serialized proto); `eos_id` is its <eos> piece."""

    def __init__(self, model_proto: bytes):
        spm = _import_sentencepiece()
        self.model_proto = bytes(model_proto)  # what a run saves beside its checkpoints
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = int(self._sp.vocab_size())
        self.eos_id = int(self._sp.eos_id())
        if self.eos_id < 0:
            raise ValueError("sentencepiece model has no <eos> piece to separate documents")
        # Two shortcuts encode a text in parts: line by line when "\n" is a user-defined piece
        # (no other piece spans it, so the ids are those of the whole text, ~1.5x faster: BPE
        # cost grows with the length of each encoded string), and a literal U+2581 on its own
        # (below). Parts encode like the whole only when the normalizer adds nothing at a
        # part's start and drops no whitespace at its ends (no dummy prefix: a "▁" before each
        # line; no removal of extra whitespace), as in the recipe trained here. A model with
        # sentencepiece's defaults (a user's own, Llama's) encodes whole texts.
        model = _model_of(model_proto)
        spec = model.normalizer_spec if model is not None else None
        in_parts = spec is not None and not (spec.add_dummy_prefix or spec.remove_extra_whitespaces)
        newline = in_parts and _newline_is_a_piece(model)
        self._newline_id = self._sp.piece_to_id("\n") if newline else None
        # A literal U+2581 is sentencepiece's own whitespace mark: encoded as text it came
        # back a space. It is encoded as its UTF-8 bytes' fallback pieces instead (decoded
        # as the character); a model without byte pieces, or one encoding whole texts, keeps
        # sentencepiece's reading.
        marks = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _MARK.encode()]
        self._mark_ids = marks if in_parts and self._sp.unk_id() not in marks else None

    def _encode(self, texts: list[str]) -> list[list[int]]:
        out = self._sp.encode(texts)
        for i, text in enumerate(texts):
            if self._mark_ids is not None and _MARK in text:
                parts = self._sp.encode(text.split(_MARK))
                out[i] = [*parts[0]]
                for part in parts[1:]:
                    out[i] += self._mark_ids + part
        return out

    def encode(self, text: str) -> np.ndarray:
        if self._newline_id is None:
            return np.asarray(self._encode([text])[0], dtype=np.int32)
        # sentencepiece answers with Python lists (~36 bytes per id): a few thousand lines
        # at a time, so a huge document does not hold all of its ids as a list at once.
        lines, chunks = text.split("\n"), []
        for start in range(0, len(lines), _LINES_PER_CALL):
            ids = []
            for i, line_ids in enumerate(self._encode(lines[start : start + _LINES_PER_CALL])):
                if i or start:
                    ids.append(self._newline_id)
                ids += line_ids
            chunks.append(np.asarray(ids, dtype=np.int32))
        return np.concatenate(chunks)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def _model_of(model_proto: bytes):
    """The model's ModelProto (pieces, normalizer options), or None without protobuf, which
    sentencepiece's model_pb2 needs (texts are then encoded whole: the same ids, slower)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as model_pb2
    except ImportError:
        return None
    model = model_pb2.ModelProto()
    model.ParseFromString(model_proto)
    return model


def _newline_is_a_piece(model) -> bool:
    user_defined = type(model).SentencePiece.USER_DEFINED
    return any(p.piece == "\n" and p.type == user_defined for p in model.pieces)


def _import_sentencepiece():
    try:
        import sentencepiece
    except ImportError as e:
        raise ImportError(
            f"data.tokenizer='sentencepiece' needs the sentencepiece package: {_SPM_INSTALL}"
        ) from e
    return sentencepiece


def default_cache_dir(cfg: DataConfig) -> epath.Path:
    return paths.resolve(cfg.cache_dir or "~/.cache/decoupled_diloco")


def train_sentencepiece(text: str, vocab_size: int, cache_dir: epath.Path) -> bytes:
    """Trains (or loads from `cache_dir`) a BPE model on `text`; returns the model proto.

    The cache key is a hash of text, vocab size and recipe, so a changed corpus retrains.
    Options chosen for an exact round trip: identity normalisation, whitespace kept as is,
    no dummy prefix, byte fallback for unseen characters, "\\n" as its own piece.
    """
    spm = _import_sentencepiece()
    digest = hashlib.sha256(f"{_SPM_RECIPE}/{vocab_size}/".encode() + text.encode()).hexdigest()
    model_path = cache_dir / "spm" / f"bpe{vocab_size}-{digest[:16]}.model"
    if model_path.exists():
        cached = model_path.read_bytes()
        try:
            spm.SentencePieceProcessor().LoadFromSerializedProto(cached)
            return cached
        except RuntimeError as e:  # (a damaged cache file: trained again, and replaced)
            logging.warning("the cached sentencepiece model %s is not readable (%s): training "
                            "it again", model_path, str(e).splitlines()[0][:200])  # fmt: skip
    try:  # before training (minutes on a big corpus): somewhere to keep the model
        model_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"data.cache_dir={str(cache_dir)!r}: cannot keep the trained tokenizer in "
            f"{model_path.parent}: {e}"
        ) from e
    lines = list(_training_lines(text))
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=proto,
            model_type="bpe",
            vocab_size=vocab_size,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            byte_fallback=True,
            character_coverage=_SPM_CHARACTER_COVERAGE,
            user_defined_symbols=["\n"],
            unk_id=0,
            eos_id=1,
            bos_id=-1,
            pad_id=-1,
            max_sentence_length=_SPM_MAX_LINE_BYTES,
            num_threads=1,  # single-threaded training is deterministic
            minloglevel=2,
        )
    except RuntimeError as e:
        too_few = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
        if too_few:  # one piece per character the coverage keeps, beside the fixed pieces
            needed = int(too_few.group(1))
            raise ValueError(
                f"data.spm_vocab_size={vocab_size} is too small for this corpus: sentencepiece "
                f"needs at least {needed} pieces, {_SPM_FIXED_PIECES} fixed ones (256 byte "
                f"pieces, <unk>, <eos>, newline) and one for each of the corpus's "
                f"{needed - _SPM_FIXED_PIECES} distinct characters at character_coverage="
                f"{_SPM_CHARACTER_COVERAGE} (a CJK corpus has thousands); set "
                f"data.spm_vocab_size >= {needed}, and more to leave room for merges"
            ) from e
        raise ValueError(
            f"data.spm_vocab_size={vocab_size}: sentencepiece could not train on this corpus "
            f"({len(text)} characters): {e}"
        ) from e
    try:
        paths.write_atomic(model_path, proto.getvalue())  # processes may train it at once
    except OSError as e:
        raise ValueError(
            f"data.cache_dir={str(cache_dir)!r}: cannot write the trained tokenizer to "
            f"{model_path}: {e}"
        ) from e
    return proto.getvalue()


def _training_lines(text: str):
    """The corpus's non-empty lines, each longer one cut into pieces sentencepiece keeps (a
    corpus of one huge line, such as text8, would otherwise train on nothing)."""
    piece = _SPM_MAX_LINE_BYTES // 4  # characters: at most 4 utf-8 bytes each
    for line in text.split("\n"):
        if len(line) <= piece or len(line.encode("utf-8")) <= _SPM_MAX_LINE_BYTES:
            if line:
                yield line
            continue
        for i in range(0, len(line), piece):
            yield line[i : i + piece]


def load_sentencepiece(model_path: str) -> SentencePieceTokenizer:
    """The sentencepiece model in the file `data.spm_model_path` names (local or gs://);
    ValueError naming the file when it is missing or not a model."""
    path = paths.resolve(model_path)
    try:
        found = path.is_file()
        folder = not found and path.is_dir()
        data = path.read_bytes() if found else b""
    except OSError as e:  # a bucket out of reach: no network, no credentials (gcsfs, aiohttp)
        raise ValueError(
            f"data.spm_model_path={model_path!r} could not be read from this machine "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}):"
            " check its network and credentials, or copy the model to a local file"
        ) from e
    if folder:
        raise ValueError(
            f"data.spm_model_path={model_path!r}: {path} is a directory; name the .model file"
        )
    if not found:
        raise ValueError(f"data.spm_model_path={model_path!r}: no such file")
    if not data:  # sentencepiece reads 0 bytes as a model without pieces
        raise ValueError(f"data.spm_model_path={model_path!r}: {path} is empty (0 bytes)")
    try:
        tokenizer = SentencePieceTokenizer(data)
    except (RuntimeError, OSError) as e:  # sentencepiece: "could not parse ModelProto"
        raise ValueError(
            f"data.spm_model_path={model_path!r}: {path} is not a readable sentencepiece "
            f"model ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
        ) from e
    except ValueError as e:  # a model without <eos>
        raise ValueError(f"data.spm_model_path={model_path!r}: {e}") from e
    known = KNOWN_SPM_PIECES.get(model_path)
    if known is not None and tokenizer.vocab_size != known:  # validation took `known` on trust
        raise ValueError(
            f"data.spm_model_path={model_path!r} holds {tokenizer.vocab_size} pieces, not the "
            f"{known} of the published model: the file has changed; copy the model you mean "
            "to your own bucket and name that"
        )
    return tokenizer


def build_tokenizer(
    cfg: DataConfig, corpus_text_for_training: Callable[[], str] | None = None
) -> Tokenizer:
    """The tokenizer `cfg` names. A sentencepiece model without `spm_model_path` is trained on
    `corpus_text_for_training()` (the corpus passes its training text: `corpus.load_corpus`
    builds the tokenizer of a config's corpus)."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer != "sentencepiece":
        raise ValueError(f"data.tokenizer={cfg.tokenizer!r}: unknown tokenizer")
    _import_sentencepiece()
    if cfg.spm_model_path:
        return load_sentencepiece(cfg.spm_model_path)
    if corpus_text_for_training is None:
        raise ValueError(
            "a sentencepiece tokenizer without data.spm_model_path is trained on its corpus: "
            "build it with decoupled_diloco.data.load_corpus(cfg).tokenizer"
        )
    proto = train_sentencepiece(
        corpus_text_for_training(), cfg.spm_vocab_size, default_cache_dir(cfg)
    )
    return SentencePieceTokenizer(proto)
