"""Tests of decoupled_diloco.data.tokenizer: a sentencepiece model a user brings (its own
normalizer options), model files that hold no model, and a vocab too small for the corpus.

The recipe trained here (round trips, the line-by-line fast path) is tested in test_data.py.
"""

import dataclasses
import io
import random
import re

import pytest

from decoupled_diloco.data import DataConfig, build_tokenizer

spm = pytest.importorskip("sentencepiece")

TEXTS = [
    "import os\nprint(os.sep)\n",
    "\nstarts with a newline\n\n\nends with three\n\n\n",
    "  two  spaces\n\n\ttab\r\n  indented\n",
    "spaces at \n the ends of lines ",
    "é ü 漢字 🙂\nß",
    "a \u2581 b\n\u2581x\u2581",  # sentencepiece's whitespace mark, literally
    "",
    " ",
    "one line, no newline",
]


def _lines(n: int = 300) -> list[str]:
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnop", k=rng.randint(2, 7))) for _ in range(40)]
    code = ["import os", "print(os.sep)", "def f(x):", "    return  x"]
    return [" ".join(rng.choices(words, k=12)) for _ in range(n)] + code * 20


def _user_model(tmp_path, **options) -> str:
    """A model trained with sentencepiece's defaults but for `options`, as a user brings one."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines()),
        model_writer=proto,
        model_type="bpe",
        vocab_size=400,
        minloglevel=2,
        **options,
    )
    path = tmp_path / "user.model"
    path.write_bytes(proto.getvalue())
    return str(path)


@pytest.fixture
def encoded(monkeypatch):
    """The strings sentencepiece is asked to encode, in order."""
    seen, encode = [], spm.SentencePieceProcessor.encode

    def spy(self, texts, *args, **kwargs):
        seen.extend([texts] if isinstance(texts, str) else texts)
        return encode(self, texts, *args, **kwargs)

    monkeypatch.setattr(spm.SentencePieceProcessor, "encode", spy)
    return seen


EXACT = dict(normalization_rule_name="identity", remove_extra_whitespaces=False)


@pytest.mark.parametrize(
    "options",
    [
        # the review's model: exact normalizer, "\n" a piece, sentencepiece's dummy prefix
        dict(**EXACT, byte_fallback=True, user_defined_symbols=["\n"]),
        dict(**EXACT, byte_fallback=True),  # Llama-style: byte pieces, dummy prefix
        dict(byte_fallback=True, user_defined_symbols=["\n"]),  # all of the defaults
        # no dummy prefix, but extra whitespace removed (the ends of each line, if split)
        dict(add_dummy_prefix=False, byte_fallback=True, user_defined_symbols=["\n"]),
    ],
    ids=["dummy_prefix", "llama_style", "defaults", "whitespace_removed"],
)
def test_a_users_model_encodes_as_sentencepiece_does(tmp_path, options, encoded):
    """Lines (and the stretches between literal "▁") were encoded apart: with a dummy prefix
    each one after the first gained a "▁", so ids differed from the model's own and decoded
    text gained a space per line."""
    path = _user_model(tmp_path, **options)
    tok = build_tokenizer(DataConfig(tokenizer="sentencepiece", spm_model_path=path))
    sp = spm.SentencePieceProcessor(model_file=path)
    expected = [sp.encode(text) for text in TEXTS]
    encoded.clear()
    for text, want in zip(TEXTS, expected, strict=True):
        ids = tok.encode(text)
        assert ids.tolist() == want, text
        if sp.decode(want) == text:
            assert tok.decode(ids) == text
    assert encoded == TEXTS  # each text whole, in one piece
    if options.get("normalization_rule_name") == "identity":  # sentencepiece round-trips lines
        assert sp.decode(sp.encode(TEXTS[0])) == TEXTS[0]


def test_the_recipe_trained_here_keeps_its_fast_paths(tmp_path, encoded):
    """No dummy prefix, whitespace kept: lines are encoded apart (fast on long documents, the
    ids of the whole text) and a literal "▁" round-trips."""
    rng = random.Random(0)
    corpus = "\n".join(rng.sample(_lines(), 200))
    cfg = DataConfig(tokenizer="sentencepiece", spm_vocab_size=400, cache_dir=str(tmp_path))
    tok = build_tokenizer(cfg, lambda: corpus)
    (model,) = (tmp_path / "spm").glob("*.model")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    for text in TEXTS:
        encoded.clear()
        ids = tok.encode(text)
        assert not any("\n" in part for part in encoded), text  # line by line
        assert tok.decode(ids) == text  # "▁" too: encoded as its bytes
        if "\u2581" not in text:  # sentencepiece reads the mark as a space
            assert ids.tolist() == sp.encode(text)
    from_file = build_tokenizer(dataclasses.replace(cfg, spm_model_path=str(model)))
    assert from_file.encode(TEXTS[0]).tolist() == tok.encode(TEXTS[0]).tolist()


@pytest.mark.parametrize("kind", ["empty", "directory", "no_eos"])
def test_a_model_path_that_holds_no_model_is_named(tmp_path, kind):
    """An empty file read as a model without pieces ("no <eos> piece", naming no file); a
    directory was "no such file"."""
    path = tmp_path / "tokenizer.model"
    if kind == "empty":
        path.write_bytes(b"")
        match = r"is empty \(0 bytes\)"
    elif kind == "directory":
        path.mkdir()
        match = "is a directory"
    else:
        path = _user_model(tmp_path, eos_id=-1, byte_fallback=True)
        match = "no <eos> piece"
    cfg = DataConfig(tokenizer="sentencepiece", spm_model_path=str(path))
    with pytest.raises(ValueError, match=rf"data.spm_model_path='{re.escape(str(path))}'.*{match}"):
        build_tokenizer(cfg)


@pytest.mark.parametrize(
    "corpus, distinct",
    [
        ("hello world\n", 8),  # h e l o w r d and the space: 259 + 8 pieces
        ("\n".join("".join(map(chr, range(0x4E00, 0x4E00 + 500)))[i::7] for i in range(7)), 500),
    ],
    ids=["english", "cjk"],
)
def test_a_vocab_below_the_corpus_characters_names_the_size_needed(tmp_path, corpus, distinct):
    """data.spm_vocab_size=260 passes validation but sentencepiece wants a piece per distinct
    character as well: its "Vocabulary size is smaller than required_chars" came unexplained."""
    cfg = DataConfig(tokenizer="sentencepiece", spm_vocab_size=260, cache_dir=str(tmp_path))
    needed = 259 + distinct
    with pytest.raises(ValueError) as error:
        build_tokenizer(cfg, lambda: corpus)
    message = str(error.value)
    assert "data.spm_vocab_size=260 is too small" in message
    assert f"needs at least {needed} pieces" in message
    assert f"{distinct} distinct characters at character_coverage=0.9995" in message
    assert f"data.spm_vocab_size >= {needed}" in message
    tok = build_tokenizer(dataclasses.replace(cfg, spm_vocab_size=needed), lambda: corpus)
    assert tok.decode(tok.encode(corpus)) == corpus  # the size it names trains
