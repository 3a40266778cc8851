"""Held-out loss of a run's global model: `python -m decoupled_diloco.evaluate --workdir=DIR`.

    python -m decoupled_diloco.evaluate --workdir=/tmp/dd_dec               # the run's eval set
    python -m decoupled_diloco.evaluate --workdir=/tmp/dd_dec --step=200    # an older checkpoint
    python -m decoupled_diloco.evaluate --workdir=/tmp/dd_dec \\
        --config.data.source=shakespeare --config.data.eval_fraction=0.05   # another corpus

Only `--config.data.*` (and `--config.train.eval_batches`) overrides apply; everything else
is the run's own config. On the run's own eval set, with the devices it evaluated on, this
prints the number in its summary.json (`final_eval_loss`).
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
    import jax
    from etils import epath

    from decoupled_diloco import run_files, sharding
    from decoupled_diloco.data import validate_data_config
    from decoupled_diloco.loading import load
    from decoupled_diloco.train.evaluate import Evaluator

    overrides = dict(data_overrides or {})
    fixed = sorted(set(overrides) & TOKENIZER_KEYS)
    if fixed:
        raise ValueError(f"data.{fixed[0]} cannot change: the model is scored with the tokenizer "
                         "it trained with (its ids are the model's vocabulary)")  # fmt: skip
    model = load(path, step)
    run = model.config
    if overrides.get("path") and "source" not in overrides:  # as in a run: path alone selects it
        overrides["source"] = "path"
    if overrides.get("source", "path") != "path" and "path" not in overrides:
        overrides["path"] = ""  # another source: the run's own corpus path no longer applies
    if run.data.tokenizer == "sentencepiece":  # the run's model file, never one trained anew
        overrides["spm_model_path"] = str(epath.Path(path) / run_files.TOKENIZER)
    data = dataclasses.replace(run.data, **overrides)
    validate_data_config(data)
    # Learner 0's devices and mesh, as the run's own evaluations used (else what there is).
    per = min(run.devices_per_learner, jax.device_count())
    mesh = sharding.make_mesh(sharding.learner_devices(jax.devices(), per, 0), run.mesh)
    batches = eval_batches or run.train.eval_batches
    evaluator = Evaluator(run.model, data, mesh, run.train.batch_size, batches)
    return evaluator(model.params), model.source


def main(argv) -> None:
    del argv
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

    try:
        loss, source = evaluate(
            FLAGS.workdir, FLAGS.step, data, overrides.get("train.eval_batches")
        )
    except (FileNotFoundError, ValueError, CorruptCheckpointError) as e:
        sys.exit(f"error: {e}")
    print(f"eval_loss={loss:.6f} ({source}; {FLAGS.workdir})", flush=True)


def _define_flags() -> None:
    flags.DEFINE_string("workdir", None, "A run's workdir, or an exported model.")
    flags.DEFINE_integer("step", None, "The newest checkpoint at or before this step.")
    config_flags.DEFINE_config_dict("config", config_lib.default_config())


if __name__ == "__main__":
    cli.run(main, _define_flags)
