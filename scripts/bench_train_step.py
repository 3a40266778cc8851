"""Tokens/second of one learner's jitted train step on 1, 2, 4 and 8 fake CPU devices.

Each cell is a pure data-parallel mesh over the first n devices, the same jit the learner
uses (explicit in/out shardings, donated state) on one fixed batch, so only the step is
timed: compile and warm up first, then `--steps` steps each ended by block_until_ready;
the median is reported. tiny and tiny_moe have equal activated parameters (~140k), not
equal compute per token: XLA counts 1.11e6 FLOPs per training token for tiny, 1.68e6 for
tiny_moe's capacity path (its dispatch and combine einsums, 1.25x capacity slots) and 2.91e6
dropless (ragged_dot lowers to a dense dot on CPU); the MoE / dense column compares the
two presets, not MoE's cost at equal work.

Memory: the process's peak RSS so far (ru_maxrss; monotone, so a row reads "peak up to
this cell"), the train state bytes held per device, and each device's peak bytes from
`memory_stats()` where the backend reports it (the CPU backend does not).

All fake devices share this machine's cores: beyond the core count more devices cannot add
compute, but XLA:CPU runs each device's small ops on few threads, so a mesh of several
devices can keep idle cores busy that one device leaves unused.

  python scripts/bench_train_step.py                       # tiny + tiny_moe, 32 x 128
  python scripts/bench_train_step.py --quick               # < 1 min
  python scripts/bench_train_step.py --presets=tiny --batch=64 --seq=256 --steps=20
  python scripts/bench_train_step.py --presets=tiny_moe --devices=4 --expert=4   # expert-parallel
  python scripts/bench_train_step.py --presets=tiny_moe --capacity_factor=0      # dropless
"""

import os

from decoupled_diloco import cli  # imports no JAX

cli.xla_flags()  # the fake CPU devices must exist before JAX initialises its backend
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from decoupled_diloco import compile_cache, models, sharding  # noqa: E402
from decoupled_diloco.train.optimizer import (  # noqa: E402
    TrainConfig,
    make_inner_optimizer,
    state_learning_rate,
)
from decoupled_diloco.train.step import TrainState, init_train_state, make_train_step  # noqa: E402

_PRESETS = flags.DEFINE_list("presets", ["tiny", "tiny_moe"], "Model presets to time.")
_DEVICES = flags.DEFINE_list("devices", ["1", "2", "4", "8"], "Device counts (data-parallel).")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step (split over the devices).")
_SEQ = flags.DEFINE_integer("seq", 128, "Tokens per sequence (the batch is [batch, seq + 1]).")
_STEPS = flags.DEFINE_integer("steps", None, "Timed steps per cell (default 10; quick 3).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compiling.")
_EXPERT = flags.DEFINE_integer(
    "expert", 1, "Expert mesh axis size for MoE presets (data axis = the remaining devices)."
)
_CAPACITY = flags.DEFINE_float(
    "capacity_factor", None, "MoE capacity factor override (<= 0: dropless); default: preset's."
)
_QUICK = flags.DEFINE_bool("quick", False, "3 timed steps, 1 warm-up step (under a minute).")
_CACHE = flags.DEFINE_string(
    "compilation_cache",
    os.environ.get("DD_COMPILATION_CACHE", compile_cache.DEFAULT_DIR),
    "Persistent XLA compilation cache ('' disables; with it, 'compile s' of a rerun is a load).",
)


def state_shardings(state: TrainState, model_cfg, mesh) -> TrainState:
    """Params by the logical rules; Adam moments (param-shaped subtrees) like their params."""
    param_sh = sharding.param_shardings(state.params, models.param_logical_axes(model_cfg), mesh)
    params_def = jax.tree.structure(state.params)

    def is_param_tree(x):
        return isinstance(x, dict) and jax.tree.structure(x) == params_def

    opt_sh = jax.tree.map(
        lambda x: param_sh if is_param_tree(x) else sharding.replicated(mesh),
        state.opt_state,
        is_leaf=is_param_tree,
    )
    return TrainState(sharding.replicated(mesh), param_sh, opt_sh)


def bytes_on_device(tree, device) -> int:
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


def device_peak_bytes(devices) -> int | None:
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None
    return max(s["peak_bytes_in_use"] for s in stats)


def model_config(preset: str) -> models.ModelConfig:
    """The preset, with --capacity_factor applied to MoE presets."""
    cfg = models.get_model_config(preset)
    if cfg.moe_layers != "none" and _CAPACITY.value is not None:
        cfg = models.get_model_config(preset, capacity_factor=_CAPACITY.value)
    return cfg


def bench_cell(preset: str, n: int, abstract: TrainState, steps: int, warmup: int) -> dict:
    """Times the train step of `preset` on a mesh over the first n devices: data parallel,
    times --expert-way expert parallel for MoE presets. The state is built on its shardings
    (`abstract`: its shapes), never gathered on one device or the host."""
    model_cfg = model_config(preset)
    train_cfg = TrainConfig(batch_size=_BATCH.value)
    expert = _EXPERT.value if model_cfg.moe_layers != "none" else 1
    mesh = sharding.make_mesh(jax.devices()[:n], sharding.MeshConfig(data=-1, expert=expert))
    state_sh = state_shardings(abstract, model_cfg, mesh)
    batch_sh = sharding.batch_sharding(mesh)
    step = jax.jit(
        make_train_step(
            model_cfg, make_inner_optimizer(train_cfg), state_learning_rate(train_cfg), mesh
        ),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, sharding.replicated(mesh)),
        donate_argnums=0,
    )
    tokens = np.random.default_rng(0).integers(
        0, model_cfg.vocab_size, size=(_BATCH.value, _SEQ.value + 1), dtype=np.int32
    )
    batch = jax.device_put(tokens, batch_sh)
    optimizer = make_inner_optimizer(train_cfg)
    init = jax.jit(lambda k: init_train_state(model_cfg, optimizer, k), out_shardings=state_sh)
    state = init(jax.random.key(0))

    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "preset": preset,
        "devices": n,
        "expert": expert,
        "params": models.count_params(model_cfg),
        "activated": models.count_params(model_cfg, activated=True),
        "compile_s": compile_s,
        "step_ms": 1e3 * median,
        "step_ms_range": (1e3 * min(times), 1e3 * max(times)),
        "tokens_per_s": _BATCH.value * _SEQ.value / median,
        "state_mib": bytes_on_device(state, jax.devices()[0]) / 2**20,
        "device_peak": device_peak_bytes(jax.devices()[:n]),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        "loss": float(metrics["loss"]),
    }


def markdown_table(rows: list[dict]) -> str:
    header = (
        "| preset | devices (expert) | params (total / activated) | compile s "
        "| step ms median (min-max) "
        "| tokens/s | state MiB/device | device peak MiB | peak RSS MiB |"
    )
    lines = [header, header_rule(header)]
    for r in rows:
        peak = "n/a" if r["device_peak"] is None else f"{r['device_peak'] / 2**20:.1f}"
        lines.append(
            f"| {r['preset']} | {r['devices']} ({r['expert']}) | {r['params'] / 1e3:.0f}k / "
            f"{r['activated'] / 1e3:.0f}k | {r['compile_s']:.1f} | {r['step_ms']:.0f} "
            f"({r['step_ms_range'][0]:.0f}-{r['step_ms_range'][1]:.0f}) "
            f"| {r['tokens_per_s']:,.0f} | {r['state_mib']:.2f} | {peak} | {r['rss_mib']:.0f} |"
        )
    return "\n".join(lines)


def header_rule(header: str) -> str:
    return "|" + "---|" * (header.count("|") - 1)


def dense_vs_moe_table(rows: list[dict]) -> str | None:
    """tokens/s of tiny_moe relative to tiny per device count (equal activated params)."""
    by = {(r["preset"], r["devices"]): r for r in rows}
    counts = [n for (p, n) in by if p == "tiny" and ("tiny_moe", n) in by]
    if not counts:
        return None
    header = "| devices | tiny tokens/s | tiny_moe tokens/s | MoE / dense |"
    lines = [header, header_rule(header)]
    for n in counts:
        dense, moe = by["tiny", n]["tokens_per_s"], by["tiny_moe", n]["tokens_per_s"]
        lines.append(f"| {n} | {dense:,.0f} | {moe:,.0f} | {moe / dense:.2f} |")
    return "\n".join(lines)


def main(argv):
    del argv
    if _CACHE.value:
        jax.config.update("jax_compilation_cache_dir", _CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    steps = _STEPS.value or (3 if _QUICK.value else 10)
    warmup = 1 if _QUICK.value else _WARMUP.value
    counts = [int(n) for n in _DEVICES.value]
    available = len(jax.devices())
    for n in counts:
        if not 1 <= n <= available:
            raise ValueError(f"--devices entry {n} must be in [1, {available}]")
        if _BATCH.value % n:
            raise ValueError(f"--batch ({_BATCH.value}) must be divisible by every --devices ({n})")
        if n % _EXPERT.value:
            raise ValueError(f"--devices entry {n} must be divisible by --expert ({_EXPERT.value})")
    rows = []
    for preset in _PRESETS.value:
        model_cfg = model_config(preset)
        optimizer = make_inner_optimizer(TrainConfig())
        init = functools.partial(init_train_state, model_cfg, optimizer)
        abstract = jax.eval_shape(init, jax.random.key(0))
        for n in counts:
            rows.append(bench_cell(preset, n, abstract, steps, warmup))
            r = rows[-1]
            print(
                f"{preset} on {n} device(s): {r['tokens_per_s']:,.0f} tokens/s "
                f"(compile {r['compile_s']:.1f} s)",
                flush=True,
            )
    print(
        f"\njax {jax.__version__}, {os.cpu_count()} CPU cores, {available} fake devices; "
        f"batch {_BATCH.value} x seq {_SEQ.value}, median of {steps} steps after {warmup} warm-up, "
        f"MoE capacity_factor {_CAPACITY.value if _CAPACITY.value is not None else 'of preset'}\n"
    )
    print(markdown_table(rows))
    comparison = dense_vs_moe_table(rows)
    if comparison:
        print("\nDense vs MoE at equal activated parameters:\n")
        print(comparison)


if __name__ == "__main__":
    cli.run_script(main)
