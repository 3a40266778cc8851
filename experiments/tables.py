"""Tables and plots of experiment results (`Result`s): per-arm grouping, ratios
paired by seed, mean ± sample std, markdown tables, eval curves and bars."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
from typing import TYPE_CHECKING

import numpy as np

from decoupled_diloco.metrics import read_jsonl
from decoupled_diloco.report import number

if TYPE_CHECKING:
    from arm_config import Arm


@dataclasses.dataclass
class Result:
    """One finished run of an arm (harness.run_arms)."""

    arm: Arm
    seed: int
    summary: dict
    rundir: pathlib.Path
    config: object  # the ConfigDict the run used (ml_collections)


def numbers(record: dict) -> dict:
    """`record` with the non-finite floats that run files write as strs ("nan", "inf",
    metrics.write_json) as floats again: a diverged run's loss is nan in every ratio and
    table, not a str that breaks them."""
    return {k: _number_or_self(v) for k, v in record.items()}


def _number_or_self(x):
    if isinstance(x, dict):
        return numbers(x)
    if isinstance(x, list):
        return [_number_or_self(v) for v in x]
    value = number(x) if isinstance(x, str) else None
    return x if value is None else value


def read_summary(rundir: pathlib.Path) -> dict:
    """The run's summary.json, non-finite numbers as floats (`numbers`)."""
    return numbers(json.loads((rundir / "summary.json").read_text()))


def rows(rundir: pathlib.Path, name: str) -> list[dict]:
    """A run file's records (`numbers`); a run killed mid-line: its torn last line left out."""
    return [numbers(r) for r in read_jsonl(rundir / name)]


def _evaluations(r: Result) -> list[dict]:
    """The metrics rows evaluating the global model (DP: its only learner), in file order."""
    no_syncer = not r.summary.get("merges") and r.summary.get("learners", 1) == 1
    ours = ("global", 0) if no_syncer else ("global",)
    return [x for x in rows(r.rundir, "metrics.jsonl") if "eval_loss" in x and x["learner"] in ours]


def eval_curve(r: Result) -> list[tuple[float, int, float]]:
    """(wall s, tokens, eval loss) of the global model (DP: its only learner), time-sorted."""
    return sorted({(x["time"], x["tokens"], x["eval_loss"]) for x in _evaluations(r)})


def eval_slots(r: Result) -> dict[int, tuple[float, int, float]]:
    """The run's evaluations (`eval_curve`'s) by the multiple of train.eval_every each was
    made for (step // eval_every: Θ is evaluated once the lead learner reaches it, a step
    or two past it on some seeds); a slot evaluated again (steps redone after a crash)
    keeps its last evaluation."""
    train = r.config.train if r.config is not None else None
    every, steps = (train.eval_every or 1, train.steps) if train else (1, 0)
    out = {}
    for x in sorted(_evaluations(r), key=lambda x: x["time"]):
        step = int(x["step"])
        # (the final evaluation has a slot of its own where the steps end between two)
        slot = -(-step // every) if steps and step >= steps else step // every
        out[slot] = (x["time"], x["tokens"], x["eval_loss"])
    return out


def param_count(r: Result) -> int:
    """The number of parameters of the model the run trained (its config's, at any scale)."""
    import jax

    from decoupled_diloco import config as config_lib
    from decoupled_diloco import models

    shapes = models.param_shapes(config_lib.validate(r.config).model)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def by_arm(results: list[Result]) -> dict[str, list[Result]]:
    out: dict[str, list[Result]] = {}
    for r in results:
        out.setdefault(r.arm.name, []).append(r)
    return out


def paired(runs: list[Result], refs: list[Result], fn) -> list[float]:
    """fn(run, ref) for every seed both arms ran (pairs by seed, never by position)."""
    ref_by_seed = {r.seed: r for r in refs}
    return [fn(r, ref_by_seed[r.seed]) for r in runs if r.seed in ref_by_seed]


def loss_ratio(runs: list[Result], refs: list[Result]) -> list[float]:
    """Per-seed final eval loss of `runs` over that of `refs`."""
    loss = "final_eval_loss"
    return paired(runs, refs, lambda a, b: a.summary[loss] / b.summary[loss])


def stat(values: list[float]) -> tuple[float, float]:
    """(mean, sample std with ddof = 1; 0 for a single value); nan where a value is nan or
    infinite (a diverged seed)."""
    values = [float(v) for v in values]
    if not values:
        return float("nan"), float("nan")
    if not all(math.isfinite(v) for v in values):  # (statistics.stdev fails on them)
        return sum(values) / len(values), float("nan") if len(values) > 1 else 0.0
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def start_below_lowest(ax, values: list[float], factor: float) -> None:
    """Starts ax's y axis at `factor` x the lowest finite value, so bars of close losses
    differ visibly; left alone where none is finite (every run diverged)."""
    low = min((v for v in values if math.isfinite(v)), default=None)
    if low is not None:
        ax.set_ylim(low * factor, None)


def json_text(obj) -> str:
    """`obj` as JSON, non-finite floats as their strs, as run files write them."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return [clean(v) for v in x] if isinstance(x, list | tuple) else x

    return json.dumps(clean(obj), indent=1)


def fmt(values: list[float], digits: int = 4, scale: float = 1.0) -> str:
    """'mean ± sample std' (just the value for one seed; '-' for none)."""
    if not values:
        return "-"
    mean, std = stat([scale * v for v in values])
    return f"{mean:.{digits}f}" if len(values) < 2 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def equal_tokens(results: list[Result]) -> int | None:
    """The tokens every run processed; None where they differ: --smoke lengths give every
    learner one batch size, not its arm's share of a total (DP then sees fewer tokens than
    M learners), and a budget or a crash may stop a run early."""
    tokens = {r.summary["tokens"] for r in results}
    return tokens.pop() if len(tokens) == 1 else None


def tokens_per_run(results: list[Result]) -> str:
    """'N tokens per run' (`equal_tokens`), or how far apart the runs' tokens are."""
    same = equal_tokens(results)
    if same is not None:
        return f"{same:,} tokens per run"
    tokens = sorted(r.summary["tokens"] for r in results)
    return f"tokens per run differ between arms ({tokens[0]:,} to {tokens[-1]:,}: not equal tokens)"


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def mean_curve(curves: list[dict[int, tuple[float, float]]]):
    """Mean, min and max of several (x, y) curves keyed by evaluation slot (`eval_slots`;
    seeds of one arm), over the slots every curve has: seeds pair by step, never by
    position, so a seed that evaluated a slot twice or skipped one does not shift the
    others. Returns (x mean, y mean, y min, y max), in slot order."""
    common = sorted(set.intersection(*(set(c) for c in curves)))
    xs = np.array([[c[k][0] for k in common] for c in curves]).reshape(len(curves), -1)
    ys = np.array([[c[k][1] for k in common] for c in curves]).reshape(len(curves), -1)
    return xs.mean(0), ys.mean(0), ys.min(0), ys.max(0)


def _color(i: int) -> str:
    """Matplotlib's i-th cycle colour: arm i of by_arm's order in every plot."""
    return f"C{i % 10}"


def plot_curves(ax, results: list[Result], x: str = "tokens") -> None:
    """Eval loss against tokens (millions) or wall time, one colour per arm; with several
    seeds, their mean with a band from the lowest to the highest seed."""
    seeds = 1
    for i, (name, runs) in enumerate(by_arm(results).items()):
        curves = []
        for r in runs:
            slots = eval_slots(r)
            if slots:
                curves.append({k: (t if x == "time" else tok / 1e6, loss)
                               for k, (t, tok, loss) in slots.items()})  # fmt: skip
        if not curves:
            continue
        seeds = max(seeds, len(curves))
        xs, mean, lo, hi = mean_curve(curves)
        label = runs[0].arm.label or name
        ax.plot(xs, mean, marker="o", ms=3, color=_color(i), label=label)
        if len(curves) > 1:
            ax.fill_between(xs, lo, hi, color=_color(i), alpha=0.2, lw=0)
    ax.set_xlabel("tokens (millions, all learners)" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("eval loss (nats / byte)")
    ax.grid(alpha=0.3)
    note = f"mean of {seeds} seeds; band: lowest to highest" if seeds > 1 else None
    ax.legend(fontsize=7, title=note, title_fontsize=7)


def arm_colors(results: list[Result], names: list[str]) -> list[str]:
    """The colour plot_curves gives each of `names` (arms of `results`): a bar chart of a
    subset of the arms keeps each arm's colour."""
    order = list(by_arm(results))
    return [_color(order.index(n)) for n in names]


def plot_bars(
    ax, names: list[str], values: list[list[float]], ylabel: str, colors: list[str] | None = None
) -> None:
    """Mean bars with sample-std error bars (one bar per arm, seeds as the spread). `colors`:
    one per bar (arm_colors keeps an arm's colour from plot_curves); default C0, C1, ..."""
    stats = [stat(v) for v in values]
    colors = colors or [_color(i) for i in range(len(names))]
    ax.bar(range(len(names)), [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3,
           color=colors)  # fmt: skip
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)  # a bar's length is its value
    ax.grid(alpha=0.3, axis="y")
