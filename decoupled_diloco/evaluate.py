"""Held-out loss of a run's global model: `python -m decoupled_diloco.evaluate --workdir=DIR`.

    python -m decoupled_diloco.evaluate --workdir=/tmp/dd_dec               # the run's eval set
    python -m decoupled_diloco.evaluate --workdir=/tmp/dd_dec --step=200    # an older checkpoint
    python -m decoupled_diloco.evaluate --workdir=/tmp/dd_dec \\
        --config.data.source=shakespeare --config.data.eval_fraction=0.05   # another corpus
    python -m decoupled_diloco.evaluate --workdir=/tmp/dd_dec --text=held_out/   # whole files

Only `--config.data.*` (and `--config.train.eval_batches`) overrides apply; everything else
is the run's own config. `--text=PATH` (a file, folder or glob, read as `data.path` reads
one) scores all of it instead of an eval split: its documents packed with the separator as
in training, cut into windows of `data.seq_len` predictions that follow one another, so
every token after the first is predicted once, from the context its window holds, up to the
last whole window (the fewer than seq_len tokens after it are not scored; the output counts
them). Only `--config.data.seq_len` applies.
On the run's own eval set, with the devices it evaluated on, this prints the number in its
summary.json (`final_eval_loss`).
"""

from decoupled_diloco import cli

cli.xla_flags()

import dataclasses  # noqa: E402
import sys  # noqa: E402

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from decoupled_diloco import config as config_lib  # noqa: E402

# What makes the tokenizer: the model's vocabulary, not an evaluation choice.
TOKENIZER_KEYS = {"tokenizer", "spm_model_path", "spm_vocab_size"}


def evaluate(
    path: str,
    step: int | None = None,
    data_overrides: dict | None = None,
    eval_batches: int | None = None,
) -> tuple[float, str]:
    """(mean held-out loss, where Θ came from) of the model at `path` on its eval split, or
    on the corpus `data_overrides` (DataConfig fields) describes."""
    from absl import logging

    from decoupled_diloco import paths, run_files
    from decoupled_diloco.data import validate_data_config
    from decoupled_diloco.data.config import unread_fields
    from decoupled_diloco.loading import load
    from decoupled_diloco.train.evaluate import Evaluator

    overrides = dict(data_overrides or {})
    fixed = sorted(set(overrides) & TOKENIZER_KEYS)
    if fixed:
        raise ValueError(f"data.{fixed[0]} cannot change: the model is scored with the tokenizer "
                         "it trained with (its ids are the model's vocabulary)")  # fmt: skip
    model = load(path, step)
    run = model.config
    if "source" not in overrides:  # as in a run: a path (or a TFDS name) alone selects it
        if overrides.get("path"):
            overrides["source"] = "path"
        elif overrides.get("tfds_name"):
            overrides["source"] = "tfds"
    if run.data.tokenizer == "sentencepiece":  # the run's model file, never one trained anew
        overrides["spm_model_path"] = str(paths.resolve(path) / run_files.TOKENIZER)
    data = dataclasses.replace(run.data, **overrides)
    # What the data now read never reads, unless the user gave it (then it is refused): the
    # run's corpus path or TFDS dataset under another source, and what a run of before
    # 2026-12-02 may record though it never read it (a tokenizer file with bytes).
    given = set(data_overrides or {})
    data = dataclasses.replace(data, **{f: "" for f, _ in unread_fields(data) if f not in given})
    validate_data_config(data)
    mesh = _learner0_mesh(run)
    if eval_batches is not None and (not isinstance(eval_batches, int) or eval_batches < 1):
        raise ValueError(f"train.eval_batches must be an integer >= 1, got {eval_batches!r}")
    batches = eval_batches or run.train.eval_batches
    _warn_past_trained(data.seq_len, run.data.seq_len)
    evaluator = Evaluator(run.model, data, mesh, run.train.batch_size, batches)
    if set(overrides) <= {"spm_model_path", "seq_len"}:  # the run's own eval split
        changed = run_files.corpus_changed(str(paths.resolve(path)), data)
        if changed:
            logging.warning(
                "the run's corpus changed since it trained (%s): its eval split may no longer "
                "be the run's held-out text, nor free of text the model trained on", changed,
            )  # fmt: skip
    else:
        own = dataclasses.replace(run.data, spm_model_path=data.spm_model_path)
        trained = _trained_on(own, data)
        if trained:
            logging.warning(
                "%d of the %d documents of this eval split are in the run's training split "
                "(%s): the model trained on them, so this loss is not held-out (the "
                "overrides cut the run's corpus another way; --text=PATH scores files of "
                "your choosing)", *trained, ", ".join(f"--config.data.{k}" for k in
                                                       sorted(data_overrides or {})),
            )  # fmt: skip
    evaluator.check_host_memory(run.model)
    return evaluator(model.params), model.source


def _trained_on(run_data, data) -> tuple[int, int] | None:
    """(how many, of how many) documents of `data`'s eval split hold text of the training
    split of the run's own corpus (`run_data`), or None: none, or it cannot tell (a TFDS
    source names no documents; the run's files are not on this machine). A document split by
    characters (one file, or every file's last part) has a train prefix and an eval suffix:
    it counts when the new eval part starts before the run's train part ends."""
    from decoupled_diloco.data import corpus, load_corpus, sources

    if not load_corpus(data).document_names["eval"]:
        return None
    try:
        trained = {d.name: len(d.text) for d in corpus.text_splits(run_data)["train"]}
    except (OSError, ValueError):
        return None
    docs = sources.read_documents(sources.corpus_files(data), data.max_corpus_bytes)
    whole = {d.name: len(d.text) for d in docs}
    _, held = sources.hold_out(docs, data.eval_fraction)
    # Offsets in the file's text: a byte cap keeps a prefix, so both runs' agree.
    seen = sum(d.name in trained and whole[d.name] - len(d.text) < trained[d.name] for d in held)
    return (seen, len(held)) if seen else None


def _warn_past_trained(seq_len: int, trained: int) -> None:
    """Windows longer than the run's score positions the model never trained on."""
    from absl import logging

    if seq_len > trained:
        logging.warning(
            "windows of %d tokens take the model to positions past the %d it trained on "
            "(data.seq_len): those were never trained", seq_len, trained,
        )  # fmt: skip


def _learner0_mesh(run):
    """Learner 0's devices and mesh, as the run's own evaluations used (else what there is)."""
    import jax

    from decoupled_diloco import sharding

    # On a machine with fewer devices than the run's learner had, the most that the mesh
    # takes and that split the batch evenly (3 of 8 do not split a batch of 32).
    most = min(run.devices_per_learner, jax.device_count())
    for n in range(most, 0, -1):
        try:
            mesh = sharding.make_mesh(sharding.learner_devices(jax.devices(), n, 0), run.mesh)
        except ValueError:
            continue  # (the mesh's fixed axes need another count)
        if run.train.batch_size % sharding.batch_axis_size(mesh) == 0:
            return mesh
    raise ValueError(
        f"the run's mesh ({run.mesh}) fits no number of this machine's {jax.device_count()} "
        f"devices up to the run's {run.devices_per_learner} per learner that divides its batch "
        f"of {run.train.batch_size}: score it on a machine with {run.devices_per_learner}"
    )


def evaluate_text(
    path: str, text: str, step: int | None = None, seq_len: int | None = None
) -> tuple[float, str, dict]:
    """(mean loss, where Θ came from, counts) of the model at `path` over every token of the
    files `text` names (module docstring), in windows of `seq_len` (default: the run's)."""
    import numpy as np

    from decoupled_diloco.data import corpus, sources
    from decoupled_diloco.loading import load
    from decoupled_diloco.train.evaluate import Evaluator

    model = load(path, step)
    run = model.config
    t = run.data.seq_len if seq_len is None else seq_len
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"data.seq_len must be an int >= 1, got {t!r}")
    try:
        docs = sources.read_documents(sources.path_files(text))
    except ValueError as e:  # the readers name the corpus key; here it is the flag
        raise ValueError(str(e).replace(f"data.path={text!r}", f"--text={text!r}")) from e
    ids = corpus.pack(model.tokenizer, [d.text for d in docs]).astype(np.int32)
    n = (len(ids) - 1) // t  # windows of t + 1 tokens, each starting at the last one's end
    if n < 1:
        raise ValueError(
            f"--text={text!r}: {len(ids)} tokens (with separators), fewer than one window "
            f"of data.seq_len + 1 = {t + 1}"
        )
    windows = np.lib.stride_tricks.sliding_window_view(ids[: n * t + 1], t + 1)[::t]
    mesh = _learner0_mesh(run)
    b = run.train.batch_size  # (a multiple of the batch-parallel devices: validated)
    # Batches of the run's size, the last filled up with copies of its last window that
    # count 0: rows never mix (attention is within a row, MoE routes each row on its own).
    pad = -n % b
    rows = np.concatenate([windows, np.repeat(windows[-1:], pad, axis=0)])
    weights = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    batches = [rows[i : i + b] for i in range(0, n + pad, b)]
    row_weights = [weights[i : i + b] for i in range(0, n + pad, b)]
    _warn_past_trained(t, run.data.seq_len)
    evaluator = Evaluator(run.model, run.data, mesh, b, 0, batches, row_weights)
    evaluator.check_host_memory(run.model)
    counts = {"files": len(docs), "tokens": len(ids), "windows": n,
              "unscored_tokens": len(ids) - 1 - n * t}  # fmt: skip
    return evaluator(model.params), model.source, counts


def main(argv) -> None:
    cli.refuse_stray_arguments(argv)
    FLAGS = flags.FLAGS
    if not FLAGS.workdir:
        sys.exit(
            "usage: python -m decoupled_diloco.evaluate --workdir=DIR [--step=N] "
            "[--config.data.<key>=VALUE ...]"
        )
    cli.start(flags.FLAGS["verbosity"].present)
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    data = {k[len("data.") :]: v for k, v in overrides.items() if k.startswith("data.")}
    other = sorted(k for k in overrides if not k.startswith("data.") and k != "train.eval_batches")
    if other:
        sys.exit(f"error: only --config.data.* and --config.train.eval_batches apply, not {other}")
    from decoupled_diloco.checkpoint import CorruptCheckpointError

    if FLAGS["text"].present and not FLAGS.text:
        sys.exit("error: --text is empty: give a file, folder or glob to score")
    if FLAGS.text:
        extra = sorted(k for k in overrides if k != "data.seq_len")
        if extra:
            sys.exit(f"error: with --text only --config.data.seq_len applies, not {extra}")
    try:
        if FLAGS.text:
            loss, source, counts = evaluate_text(
                FLAGS.workdir, FLAGS.text, FLAGS.step, data.get("seq_len")
            )
        else:
            loss, source = evaluate(
                FLAGS.workdir, FLAGS.step, data, overrides.get("train.eval_batches")
            )
    except (FileNotFoundError, ValueError, CorruptCheckpointError) as e:
        sys.exit(f"error: {e}")
    except RuntimeError as e:
        cli.exit_if_out_of_memory(e, "a shorter --config.data.seq_len, or the evaluation "
                                  "on a device with more memory")  # fmt: skip
        raise
    if FLAGS.text:
        print(
            f"eval_loss={loss:.6f} over {FLAGS.text}: {counts['windows']} windows, "
            f"{counts['tokens'] - 1 - counts['unscored_tokens']} tokens predicted, "
            f"{counts['unscored_tokens']} after the last window not ({source}; {FLAGS.workdir})",
            flush=True,
        )
        return
    print(f"eval_loss={loss:.6f} ({source}; {FLAGS.workdir})", flush=True)


def _define_flags() -> None:
    flags.DEFINE_string("workdir", None, "A run's workdir, or an exported model.")
    flags.DEFINE_integer("step", None, "The newest checkpoint at or before this step.")
    flags.DEFINE_string(
        "text",
        None,
        "Score all of these files (a file, folder or glob) instead of an eval split: every "
        "token predicted once, in windows of data.seq_len.",
    )
    config_flags.DEFINE_config_dict("config", config_lib.default_config())


if __name__ == "__main__":
    cli.run(main, _define_flags)
