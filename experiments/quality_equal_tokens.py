r"""Quality at equal tokens: Decoupled DiLoCo vs data-parallel, DiLoCo and Streaming DiLoCo.

    pip install -e .   # once
    python experiments/quality_equal_tokens.py                 # 300 steps, seed 0
    python experiments/quality_equal_tokens.py --seeds=0,1     # mean ± std over seeds
    python experiments/quality_equal_tokens.py --quick         # 100 steps per learner
    python experiments/quality_equal_tokens.py --arms=dp,decoupled,decoupled_m2,decoupled_m8
    python experiments/quality_equal_tokens.py --arms=dp_moe,decoupled_moe   # the MoE pair

Arms (every one sees 300 x 128 sequences x 128 tokens = 4.9M tokens of the Python stdlib
corpus, byte-level, the tiny Gemma-style model):
  dp         configs/tiny_dense_4x.py: one learner over 8 devices, batch 128
  decoupled  configs/tiny_decoupled.py: M=4 learners x batch 32, K=1, grace, token weights, RDA
  diloco     configs/tiny_diloco.py: P=1, K=M, synchronous, plain mean
  streaming  configs/tiny_streaming.py: P=6, K=M, synchronous, tau=1, overwrite with alpha=0.5
  decoupled_m2 / decoupled_m8   tiny_decoupled.py with M=2 x batch 64 / M=8 x batch 16
  dp_moe     configs/tiny_moe.py at batch 128 (the MoE arms' reference)
  decoupled_moe  configs/tiny_moe_decoupled.py: M=4 x batch 32
Runtime on 2 cores: DP ~9 min, each 4-learner arm ~3.5 min (--quick: a third).
Each run's seed also seeds its data order (`seed` and `data.seed`). Every arm is evaluated
on the same 512 held-out sequences (eval_batches x batch_size = 512). Arms run one after
the other, so each has the whole machine. Writes into --out:
  quality_equal_tokens.md    final eval loss per arm (mean ± std over seeds), ratio to DP,
                             merges, bytes per token (DP: ring all-reduce model, below)
  quality_equal_tokens.json  every summary and eval curve
  quality_equal_tokens.png   eval loss against tokens

Bytes per token, each byte counted once when it crosses between learners (or replicas) and
the syncer; traffic inside one learner's mesh exists in every method and is not counted.
Decoupled/DiLoCo/Streaming: the syncer's offers in + replies out, over all tokens of all
learners (summary `bytes_per_token`). DP over the same M groups of devices as replicas: a
ring all-reduce of fp32 gradients every step moves 2·(M−1)/M·S bytes out of each replica
(S = 4 bytes x params), i.e. 2·(M−1)·S per step for M·b·T tokens.
"""

import ast
import importlib.util
import json
import math
import os
import pathlib
import shutil
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco import models  # noqa: E402
from decoupled_diloco.runtime import launch  # noqa: E402

flags.DEFINE_string("out", "experiments/results/quality_equal_tokens", "Output directory.")
flags.DEFINE_string("workdir", "/tmp/dd_quality", "Run directories (wiped per run).")
flags.DEFINE_list("seeds", ["0"], "Seeds; each arm runs once per seed.")
flags.DEFINE_list("arms", ["dp", "decoupled", "diloco", "streaming"], "Arms to run.")
flags.DEFINE_bool("quick", False, "100 steps per learner instead of 300 (same for every arm).")
flags.DEFINE_integer("steps", None, "Steps per learner for every arm (warmup 10%, 4 evals).")
flags.DEFINE_multi_string("set", [], "Extra override for every non-DP arm: key=value.")
FLAGS = flags.FLAGS

CONFIGS = {
    "dp": "tiny_dense_4x.py",
    "decoupled": "tiny_decoupled.py",
    "diloco": "tiny_diloco.py",
    "streaming": "tiny_streaming.py",
    "decoupled_m2": "tiny_decoupled.py",
    "decoupled_m8": "tiny_decoupled.py",
    "dp_moe": "tiny_moe.py",
    "decoupled_moe": "tiny_moe_decoupled.py",
}
LABELS = {
    "dp": "data-parallel (batch 128)",
    "decoupled": "Decoupled DiLoCo (M=4, K=1, grace)",
    "diloco": "DiLoCo (P=1, K=M)",
    "streaming": "Streaming DiLoCo (P=6, K=M)",
    "decoupled_m2": "Decoupled DiLoCo (M=2 x batch 64)",
    "decoupled_m8": "Decoupled DiLoCo (M=8 x batch 16)",
    "dp_moe": "MoE data-parallel (batch 128)",
    "decoupled_moe": "MoE Decoupled DiLoCo (M=4, K=1, grace)",
}
# Arm-specific overrides: every arm processes 128 sequences per step in total.
ARM_OVERRIDES = {
    "decoupled_m2": {"diloco.learners": 2, "train.batch_size": 64},
    "decoupled_m8": {"diloco.learners": 8, "train.batch_size": 16},
    "dp_moe": {"train.batch_size": 128},
}
REFERENCE = {"dp_moe": "dp_moe", "decoupled_moe": "dp_moe"}  # ratio to; default "dp"
DATA_PARALLEL = ("dp", "dp_moe")
EVAL_SEQUENCES = 512  # the same held-out windows for every arm
QUICK = {"train.steps": 100, "train.warmup_steps": 10, "train.eval_every": 25}
CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _set(c, key: str, value) -> None:
    *path, last = key.split(".")
    node = c
    for p in path:
        node = node[p]
    node[last] = value


def _literal(text: str):
    """'0.4' -> 0.4, 'True' -> True, 'rda' -> 'rda'."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def make_config(arm: str, seed: int, quick: bool, extra: dict):
    spec = importlib.util.spec_from_file_location(f"cfg_{arm}", CONFIG_DIR / CONFIGS[arm])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.seed = seed
    c.data.seed = seed
    c.train.checkpoint_every = 0  # only the final one
    for key, value in ARM_OVERRIDES.get(arm, {}).items():
        _set(c, key, value)
    c.train.eval_batches = EVAL_SEQUENCES // c.train.batch_size
    for key, value in (QUICK if quick else {}).items():
        _set(c, key, value)
    if FLAGS.steps:
        c.train.steps = FLAGS.steps
        c.train.warmup_steps = max(FLAGS.steps // 10, 1)
        c.train.eval_every = max(FLAGS.steps // 4, 1)
    if c.train.eval_every:  # DP evaluates only on its logged steps
        c.train.log_every = math.gcd(c.train.log_every, c.train.eval_every)
    if arm not in DATA_PARALLEL:
        for key, value in extra.items():
            _set(c, key, value)
    return c


def eval_curve(workdir: pathlib.Path, arm: str) -> list[tuple[int, float]]:
    """(tokens, eval loss): DP evaluates in its learner, the others evaluate the global model."""
    curve = []
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            who = r.get("learner")
            dp = arm in DATA_PARALLEL
            if "eval_loss" in r and (who == "global" or (dp and who == 0)):
                curve.append((r["tokens"], r["eval_loss"]))
    return sorted(set(curve))


def run_one(arm: str, seed: int, quick: bool, extra: dict) -> dict:
    workdir = pathlib.Path(FLAGS.workdir) / f"{arm}_seed{seed}"
    if workdir.exists():
        shutil.rmtree(workdir)  # a stale run would be resumed from its checkpoints
    run = config_lib.validate(make_config(arm, seed, quick, extra))
    print(f"--- {arm} seed {seed}: {LABELS[arm]}", flush=True)
    t0 = time.time()
    summary = launch.run(run, str(workdir), verbose=True)
    print(
        f"--- {arm} seed {seed}: final eval {summary['final_eval_loss']:.4f} tokens "
        f"{summary['tokens']:,} merges {summary.get('merges', 0)} in {time.time() - t0:.0f} s",
        flush=True,
    )
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(_abstract_params(run.model)))
    return {
        "summary": summary,
        "curve": eval_curve(workdir, arm),
        "params": params,
        "learners": run.num_learners,
        "tokens_per_learner_step": run.train.batch_size * run.data.seq_len,
        "seq_len": run.data.seq_len,
    }


def _abstract_params(model_cfg):
    return jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.key(0)))


def dp_allreduce_bytes_per_token(params: int, replicas: int, tokens_per_replica_step: int) -> float:
    """Ring all-reduce of fp32 gradients across `replicas`, every byte counted once.

    Each replica sends 2·(N−1)/N·S bytes per step (reduce-scatter + all-gather, S = 4·params),
    so N replicas move 2·(N−1)·S per step while processing N·tokens_per_replica_step tokens.
    """
    if replicas < 2:
        return 0.0
    size = 4 * params
    return 2 * (replicas - 1) * size / (replicas * tokens_per_replica_step)


def _stats(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.4f}"
    return f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f}"


DP_REPLICAS = 4  # DP's all-reduce is modelled over the device groups of the M = 4 learners


def markdown(results: dict, seeds: list[int], quick: bool) -> str:
    any_run = next(iter(results.values()))[0]
    seqs = 128  # sequences per step, all learners together, in every arm
    per_replica = seqs // DP_REPLICAS * any_run["seq_len"]  # tokens per replica step
    out = [
        f"Equal tokens{' (--quick)' if quick else ''}: {any_run['summary']['tokens']:,} tokens "
        f"per run, seeds {seeds}; stdlib corpus, byte-level; eval on {EVAL_SEQUENCES} held-out "
        "sequences (nats/byte). Ratio = arm / its data-parallel reference (dense arms: DP; MoE "
        "arms: MoE DP), per seed, then averaged.",
        "",
        "| arm | params | final eval loss | ratio to DP | merges | learners / merge "
        "| bytes / token | bytes vs DP | wall (s) |",
        "|---" * 9 + "|",
    ]
    for arm, runs in results.items():
        ref = REFERENCE.get(arm, "dp")
        ref_loss = [r["summary"]["final_eval_loss"] for r in results.get(ref, [])]
        losses = [r["summary"]["final_eval_loss"] for r in runs]
        ratio = (
            _stats([a / b for a, b in zip(losses, ref_loss, strict=True)])
            if len(ref_loss) == len(losses)
            else "-"
        )
        s = [r["summary"] for r in runs]
        dp_bpt = dp_allreduce_bytes_per_token(runs[0]["params"], DP_REPLICAS, per_replica)
        bpt = dp_bpt if arm in DATA_PARALLEL else statistics.mean(x["bytes_per_token"] for x in s)
        merges = statistics.mean(x.get("merges", 0) for x in s)
        per_merge = statistics.mean(x.get("mean_learners_per_merge", 0.0) for x in s)
        wall = statistics.mean(x["wall_seconds"] for x in s)
        dp_tag = " (model)" if arm in DATA_PARALLEL else ""
        out.append(
            f"| {LABELS[arm]} | {runs[0]['params']:,} | {_stats(losses)} | {ratio} | {merges:.0f} "
            f"| {per_merge:.2f} | {bpt:.1f}{dp_tag} | {bpt / dp_bpt:.3f} | {wall:.0f} |"
        )
    out += [
        "",
        f"DP bytes/token: ring all-reduce of fp32 gradients over {DP_REPLICAS} replicas (the "
        f"M = 4 learners' device groups), 2·({DP_REPLICAS}−1)·4·params bytes per step over "
        f"{seqs} sequences.",
    ]
    return "\n".join(out) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (arm, runs) in enumerate(results.items()):
        for k, r in enumerate(runs):
            tokens, loss = zip(*r["curve"], strict=True)
            ax.plot(
                [t / 1e6 for t in tokens], loss, marker="o", ms=3, color=f"C{i}",
                alpha=1.0 if k == 0 else 0.5, label=LABELS[arm] if k == 0 else None,
            )  # fmt: skip
    ax.set_xlabel("tokens (millions, all learners)")
    ax.set_ylabel("eval loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Eval loss vs tokens at an equal token budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax is chatty at INFO
    jax.config.update(
        "jax_compilation_cache_dir",
        os.environ.get("DD_COMPILATION_CACHE", os.path.expanduser("~/.cache/decoupled_diloco_jax")),
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    unknown = [a for a in FLAGS.arms if a not in CONFIGS]
    if unknown:
        raise ValueError(f"--arms: unknown {unknown}; choose from {sorted(CONFIGS)}")
    seeds = [int(s) for s in FLAGS.seeds]
    extra = {k: _literal(v) for k, v in (kv.split("=", 1) for kv in FLAGS.set)}
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    if extra:  # the table and plot must say the arms were changed
        tag = ", ".join(f"{k}={v}" for k, v in extra.items())
        LABELS.update({a: f"{LABELS[a]} [{tag}]" for a in LABELS if a != "dp"})
    results: dict[str, list[dict]] = {arm: [] for arm in FLAGS.arms}
    for seed in seeds:
        for arm in FLAGS.arms:
            results[arm].append(run_one(arm, seed, FLAGS.quick, extra))
    table = markdown(results, seeds, FLAGS.quick)
    (out / "quality_equal_tokens.md").write_text(table)
    (out / "quality_equal_tokens.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "quality_equal_tokens.png")
    print(table)
    print(f"wrote {out}/quality_equal_tokens.{{md,json,png}}")


if __name__ == "__main__":
    app.run(main)
