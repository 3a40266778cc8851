"""The text `sample` gives back: what the model's tokens add after the prompt."""

import io

import jax
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import loading, models
from decoupled_diloco.data.tokenizer import ByteTokenizer, SentencePieceTokenizer
from decoupled_diloco.models import decode
from decoupled_diloco.sample import _completion, sample


def _dummy_prefix_tokenizer() -> SentencePieceTokenizer:
    """A pre-trained model as Llama's and T5's are: sentencepiece's defaults, which add a
    dummy "▁" before a text and drop it again when decoding the text's first piece."""
    spm = pytest.importorskip("sentencepiece")
    proto = io.BytesIO()
    lines = [f"line {i}: the quick brown fox jumps over a lazy dog." for i in range(500)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=proto,
                                   vocab_size=120, model_type="bpe", unk_id=0, eos_id=1,
                                   bos_id=-1, pad_id=-1, minloglevel=2)  # fmt: skip
    tok = SentencePieceTokenizer(proto.getvalue())
    assert tok.decode(tok.encode(" brown")) == "brown"  # (the behaviour this is about)
    return tok


@pytest.mark.parametrize("kind", ["dummy_prefix", "bytes"])
def test_a_completion_keeps_the_space_its_first_piece_holds(kind):
    tok = _dummy_prefix_tokenizer() if kind == "dummy_prefix" else ByteTokenizer()
    prompt = list(tok.encode("the quick"))
    new = list(tok.encode("the quick brown fox"))[len(prompt) :]
    assert _completion(tok, prompt, new) == " brown fox"
    # After the separator (an empty prompt) a document starts: no space to keep.
    assert _completion(tok, [tok.eos_id], list(tok.encode("brown fox"))) == "brown fox"


def test_sample_with_a_dummy_prefix_tokenizer_reads_prompt_then_completion(monkeypatch):
    """The prompt and its sample, printed one after the other, read "the quickbrown fox": the
    sample was decoded on its own, and its first piece's space dropped."""
    from conftest import _small_config

    tok = _dummy_prefix_tokenizer()
    run = config_lib.validate(_small_config())
    params = models.flatten_params(models.init_params(run.model, jax.random.key(0)))
    model = loading.Model(run, tok, jax.tree.map(np.asarray, params), "test")
    monkeypatch.setattr(loading, "load", lambda path, step=None: model)
    said = list(tok.encode(" brown fox"))

    def generate(cfg, params, prompts, max_new_tokens, *args, **kwargs):
        # The model's tokens are the ones under test here, not how they were chosen.
        assert max_new_tokens == len(said)
        return np.asarray([p + said for p in prompts])

    monkeypatch.setattr(decode, "generate", generate)
    ((prompt, completion),) = sample("unused", ["the quick"], len(said))
    assert prompt + completion == "the quick brown fox"
