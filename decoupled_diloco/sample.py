"""Text from a run's global model: `python -m decoupled_diloco.sample --workdir=DIR`.

    python -m decoupled_diloco.sample --workdir=/tmp/dd_dec --prompt="def main(" \\
        --max_new_tokens=200 --temperature=0.8 --top_k=40 --num_samples=2
    python -m decoupled_diloco.sample --workdir=/tmp/dd_dec --prompt="import os" \\
        --prompt="class " --temperature=0     # greedy; several prompts in one batch

The run's own model (dense or MoE, its attention pattern and soft-caps) decodes with a KV
cache, one jitted step per token (decoupled_diloco/models/decode.py). MoE layers with a
capacity (`capacity_factor > 0`) keep each row's claimed expert slots in the cache, so a
sample drops the tokens a whole-sequence forward pass of its training length would drop.
"""

from decoupled_diloco import cli

cli.xla_flags()

import sys  # noqa: E402

from absl import flags  # noqa: E402


def sample(
    path: str,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    num_samples: int = 1,
    step: int | None = None,
):
    """[(prompt, completion text)] for every prompt (a str is one prompt), `num_samples`
    times each."""
    import math

    import jax
    from absl import logging

    from decoupled_diloco import seeds
    from decoupled_diloco.loading import load
    from decoupled_diloco.models.decode import cache_bytes, free_bytes, generate

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"--prompt: give one or more prompts as text (\"\" starts a "
                         f"document), got {prompts!r}")  # fmt: skip
    for p in prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:  # (bytes the shell passed that are not UTF-8)
            raise ValueError(f"--prompt={p!r} is not valid UTF-8 text ({e.reason})") from e
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed),
                        ("num_samples", num_samples)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"--{name} must be an int, got {value!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {num_samples}")
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    if top_k < 0:
        raise ValueError(f"--top_k must be >= 0 (0 = the whole vocabulary), got {top_k}")
    if not 0 <= seed < 2**63:  # (as the run's seeds: JAX's key takes a 64-bit int)
        raise ValueError(f"--seed must be an int in [0, 2**63), got {seed}")
    model = load(path, step)
    tok = model.tokenizer
    # The tokenizer's ids only: a model's embedding may be padded past them.
    vocab = min(int(tok.vocab_size), model.config.model.vocab_size)
    if top_k > vocab:
        raise ValueError(f"--top_k={top_k} is more than the model's vocabulary ({vocab}); "
                         "0 samples from all of it")  # fmt: skip
    # Rows x their least length in KV cache, before the lists of them are made (a count of
    # samples in the billions made them, gigabytes, before `generate` held its plan).
    rows, shortest = len(prompts) * num_samples, 1 + max_new_tokens
    least, free = cache_bytes(model.config.model, rows, shortest), free_bytes(jax.devices()[0])
    if free is not None and least > free:
        raise ValueError(
            f"{len(prompts)} prompt(s) x --num_samples={num_samples} x at least {shortest} "
            f"tokens need {least / 2**30:.1f} GiB of KV cache, more than the "
            f"{free / 2**30:.1f} GiB free: fewer --num_samples or --max_new_tokens"
        )
    batch = [p for p in prompts for _ in range(num_samples)]
    # An empty prompt starts a document: the separator the corpus's documents follow.
    encoded = {p: [int(i) for i in tok.encode(p)] or [int(tok.eos_id)] for p in prompts}
    ids = [encoded[p] for p in batch]
    # The model reads every token of a sample but its last: seq_len positions were trained.
    trained = model.config.data.seq_len
    read = max(len(x) for x in ids) + max_new_tokens - 1
    if read > trained:
        logging.warning(
            "samples of up to %d tokens take the model to position %d, past the %d it "
            "trained on (data.seq_len): those were never trained, and each token costs "
            "more as the cache grows", read + 1, read, trained,
        )  # fmt: skip
    out = generate(
        model.config.model,
        model.device_params(),
        ids,
        max_new_tokens,
        temperature,
        top_k,
        seeds.key(seed),
        vocab,
        moe_group=trained,  # a capacity MoE routes a sample as it routed a training row
    )
    # A batch advances every row to the longest prompt + max_new_tokens: a shorter prompt's
    # row runs on past its own max_new_tokens, which are all it keeps.
    return [
        (p, _completion(tok, row[: len(x)], row[len(x) : len(x) + max_new_tokens]))
        for p, x, row in zip(batch, ids, out, strict=True)
    ]


def _completion(tok, prompt_ids, new_ids) -> str:
    """The text `new_ids` add after `prompt_ids`. Decoded alone, a sentencepiece model with a
    dummy prefix (Llama's, T5's) drops the leading space of their first piece ("▁brown"
    starts a text as "brown"): prompt and sample read "the quickbrown". Decoded after the
    prompt, the sample's text is what follows the prompt's own."""
    before = tok.decode(prompt_ids)
    whole = tok.decode([*prompt_ids, *new_ids])
    # (a normalizer could decode the prompt otherwise in context: then the sample alone)
    return whole[len(before) :] if whole.startswith(before) else tok.decode(new_ids)


def main(argv) -> None:
    cli.refuse_stray_arguments(argv)
    FLAGS = flags.FLAGS
    if not FLAGS.workdir:
        sys.exit('usage: python -m decoupled_diloco.sample --workdir=DIR [--prompt="TEXT" ...]')
    cli.start(flags.FLAGS["verbosity"].present)
    from decoupled_diloco.checkpoint import CorruptCheckpointError

    try:
        results = sample(
            FLAGS.workdir,
            FLAGS.prompt,
            FLAGS.max_new_tokens,
            FLAGS.temperature,
            FLAGS.top_k,
            FLAGS.seed,
            FLAGS.num_samples,
            FLAGS.step,
        )
    except (FileNotFoundError, ValueError, CorruptCheckpointError) as e:
        sys.exit(f"error: {e}")
    except RuntimeError as e:
        cli.exit_if_out_of_memory(e, "shorter prompts, fewer of them, or fewer --num_samples")
        raise
    for i, (prompt, completion) in enumerate(results):
        print(f"--- sample {i} ---\n{prompt}{completion}", flush=True)


def _define_flags() -> None:
    flags.DEFINE_string("workdir", None, "A run's workdir, or an exported model.")
    flags.DEFINE_multi_string(
        "prompt", ["\n"], 'Prompt text (repeat for a batch); "" starts a new document.'
    )
    flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate per sample.")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.")
    flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 = all.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("num_samples", 1, "Samples per prompt.")
    flags.DEFINE_integer("step", None, "The newest checkpoint at or before this step.")


if __name__ == "__main__":
    cli.run(main, _define_flags)
