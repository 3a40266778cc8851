"""Entry point: `python -m decoupled_diloco.main --config=configs/<file>.py --workdir=DIR`.

Any config key can be overridden: `--config.diloco.learners=4 --config.train.steps=100`.
Restarting with the same --workdir resumes from its checkpoints.
"""

import os
import sys

from absl import app, flags, logging

_CPU_DEVICES = 8
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Fake CPU devices to partition between learners; only affects the CPU backend.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_CPU_DEVICES}"
    ).strip()

from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an ml_collections config file under configs/.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (metrics, checkpoints, summary).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv) -> None:
    del argv
    import jax

    from decoupled_diloco import compile_cache
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.runtime import launch

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    compile_cache.enable()
    try:
        run = config_lib.validate(_CONFIG.value)
    except ValueError as e:
        sys.exit(f"config error: {e}")
    logging.info("devices: %s", jax.devices())
    summary = launch.run(run, _WORKDIR.value)
    print(
        f"done: final_eval_loss={summary['final_eval_loss']:.4f} steps={summary['steps']} "
        f"tokens={summary['tokens']} wall={summary['wall_seconds']:.1f}s "
        f"merges={summary.get('merges', 0)} goodput={summary.get('goodput', 0):.3f} "
        f"-> {os.path.join(_WORKDIR.value, 'summary.json')}",
        flush=True,
    )


if __name__ == "__main__":
    app.run(main)
