"""One run in plots and a short table: `python -m decoupled_diloco.report --workdir=DIR`.

    python -m decoupled_diloco.report --workdir=/tmp/dd_dec     # -> /tmp/dd_dec/report.png

Panels: train loss (per learner) and the global model's eval loss against tokens and against
wall time, with faults on the time axis (crashes, rejoins, syncer outages, members joining
and leaving, learners out for good); from merges.jsonl, learners per merge and staleness,
and quorum wait and grace used, over time; MoE expert load per layer where the model has
experts. The table (printed, and written to report.md) gives the run's summary and
per-learner figures.
"""

import json
import statistics
import sys

from absl import flags

from decoupled_diloco import cli, paths
from decoupled_diloco.metrics import read_jsonl

FAULT_MARKS = {  # event -> (colour, label) on the time axes
    "learner_down": ("tab:red", "learner down"),
    "nan_restart": ("tab:purple", "NaN restart"),
    "nan_at_end": ("tab:purple", "NaN at the end (work not offered)"),
    "rejoin": ("tab:green", "rejoin"),
    "member_join": ("tab:olive", "member joins"),
    "learner_leave": ("tab:gray", "member leaves"),
    # Out for good: Ray's restarts exhausted, stopped for repeating one error, or down when
    # its membership ended (under Ray also after either of the first two).
    "learner_lost": ("darkred", "learner lost (restarts exhausted)"),
    "learner_stopped": ("tab:brown", "learner stopped (same error repeated)"),
    "learner_gone": ("tab:pink", "learner gone for good"),
    "syncer_crash": ("black", "syncer down"),
    "syncer_restore": ("tab:cyan", "syncer restored"),
}


def _numbers(name: str, r: dict) -> tuple[str, ...]:
    """The keys of a record of run file `name` that the panels and the table read as numbers
    (other keys, and other records, are free)."""
    if name == "metrics.jsonl" and "loss" in r:  # a learner's training row
        return ("step", "tokens", "time", "loss", "tokens_per_second")
    if name == "metrics.jsonl" and "eval_loss" in r:
        return ("tokens", "time", "eval_loss")
    if name == "merges.jsonl":
        return ("time", "quorum_wait", "grace")
    if name == "events.jsonl" and r.get("event") in FAULT_MARKS:
        return ("time",)
    return ()


# metrics.jsonl writes a non-finite float as its str (metrics._clean)
_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def number(x):
    """`x` as a float or int when it is one (or a non-finite float's str, as run files
    write them), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int | float):
        return x
    return _NON_FINITE.get(x) if isinstance(x, str) else None


def _rows(workdir: str, name: str) -> list[dict]:
    """The records of the run file `name`; a damaged one is a ValueError naming it (a last
    line cut short, a run still writing it, is left out)."""
    path = paths.resolve(workdir) / name
    try:
        records = read_jsonl(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not text ({e.reason} at byte {e.start})") from e
    out = []
    for i, r in enumerate(records, 1):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: record {i} is a JSON {type(r).__name__}, not an object")
        if name == "metrics.jsonl" and "learner" not in r:
            raise ValueError(f"{path}: record {i} names no learner")
        for key in _numbers(name, r):
            value = number(r.get(key))
            if value is None:
                how = f": {key} is {r[key]!r}, not a number" if key in r else f" has no {key}"
                raise ValueError(f"{path}: record {i}{how}")
            r = {**r, key: value}
        if name == "merges.jsonl" and not (
            isinstance(r.get("learners"), list)
            and isinstance(r.get("staleness"), list)
            and r["staleness"]
            and all(number(x) is not None for x in r["staleness"])
        ):
            raise ValueError(f"{path}: record {i} lacks its learners or staleness list")
        out.append(r)
    return out


# How far a killed attempt's records may run past its wall seconds in attempts.jsonl: its
# heartbeat (workdir.Attempt, every 5 s) writes them, so the last reading is up to that short.
HEARTBEAT_S = 5.0


def attempt_of(
    rows: list[dict], seconds: list[float] | None = None, pids: list[int | None] | None = None
) -> list[int]:
    """Which attempt of a resumed run wrote each of `rows` (one file's records, in file
    order: attempt k's records all come before attempt k+1's): the `attempt` each record
    carries, where all do. Records of runs before 2026-12-01 carry none, and then a record
    opens a later attempt when it
      - carries the `pid` of a later attempt's process (`pids`, attempts.jsonl: a learner's
        start event on the local runtime), or is a syncer shard restoring its checkpoint
        other than after a failure (a resumed run's shards do that first thing, once each);
      - is later than its attempt lived to write (`seconds`, each attempt's wall seconds
        from attempts.jsonl, known to within the heartbeat);
      - is a learner's metrics row earlier than that learner's row before it (one thread
        writes them, on one clock), or falls far below the latest time of its attempt (a
        new clock from 0: records of several threads may land slightly out of order).
    Records after the latest one of an attempt, with times below it, just before a later
    attempt's pid are that attempt's first ones (a syncer's joins precede the learners'
    start events)."""
    if rows and all(isinstance(r.get("attempt"), int) for r in rows):
        return [r["attempt"] for r in rows]  # stamped by the run (RunLog), since 2026-12-01
    marker = {pid: k for k, pid in enumerate(pids or ()) if pid is not None}
    out, k, latest, peak = [], 0, 0.0, -1
    restored: set | None = set()  # shards the attempt restored, while it wrote nothing else
    last_row: dict = {}  # learner -> the time of its latest metrics row in the attempt

    def opens(i: int, later: int) -> None:
        nonlocal k, latest, peak, restored
        k, latest, peak, restored = later, 0.0, i - 1, set()
        last_row.clear()

    for i, r in enumerate(rows):
        t = r.get("time")
        if not isinstance(t, int | float):
            out.append(k)
            continue
        later = marker.get(r.get("pid"), -1)
        writer = r["learner"] if "learner" in r and "event" not in r else None  # a row
        resumed = r.get("event") == "syncer_restore" and r.get("after_failure") is False
        if resumed and (k == 0 or restored is None or r.get("shard") in restored):
            later = max(later, k + 1)  # (attempt 0 is a fresh run: it restores nothing)
        if later > k:
            for j in range(peak + 1, i):  # the new attempt's records before its marker
                tj = rows[j].get("time")
                if out[j] == k and isinstance(tj, int | float) and tj < latest and tj <= t:
                    out[j] = later
            opens(i, later)
        elif t < last_row.get(writer, t) or (t < 0.5 * latest and latest - t > 1.0):
            opens(i, k + 1)  # the next attempt's clock
        while seconds and k < len(seconds) - 1 and t > seconds[k] + HEARTBEAT_S:
            opens(i, k + 1)  # past what attempt k lived to write
        restored = restored | {r.get("shard")} if resumed and restored is not None else None
        if t >= latest:
            latest, peak = t, i
        if writer is not None:
            last_row[writer] = t
        out.append(k)
    return out


def attempt_offsets(
    files: list[list[dict]], owners: list[list[int]], seconds: list[float] | None = None
) -> list[float]:
    """Where each attempt starts on the run's clock: after the attempts before it, each
    lasting its wall seconds (attempts.jsonl) or its latest record in any of `files`
    (`owners`: each record's attempt), whichever is longer, so attempts never overlap."""
    n = max([len(seconds or ())] + [max(o, default=0) + 1 for o in owners])
    span = [(seconds[k] if seconds and k < len(seconds) else 0.0) for k in range(n)]
    for rows, owner in zip(files, owners, strict=True):
        for r, k in zip(rows, owner, strict=True):
            if isinstance(r.get("time"), int | float):
                span[k] = max(span[k], r["time"])
    offsets = [0.0]
    for k in range(n - 1):
        offsets.append(offsets[-1] + span[k])
    return offsets


def run_time(
    rows: list[dict],
    attempt_seconds: list[float] | None = None,
    pids: list[int | None] | None = None,
) -> list[dict]:
    """`rows` (one file's records, in file order) with `time` on the run's clock: each
    attempt of a resumed run counts time from its own start (`attempt_of`), and moves by the
    attempts before it (`attempt_offsets`)."""
    return on_one_clock([rows], attempt_seconds, pids)[0]


def on_one_clock(
    files: list[list[dict]],
    attempt_seconds: list[float] | None = None,
    pids: list[int | None] | None = None,
) -> list[list[dict]]:
    """Several files of one run (`run_time`) on one clock: an attempt moves by the same
    offset in every file."""
    owners = [attempt_of(rows, attempt_seconds, pids) for rows in files]
    offsets = attempt_offsets(files, owners, attempt_seconds)
    return [
        [{**r, "time": r["time"] + offsets[k]} if isinstance(r.get("time"), int | float) else r
         for r, k in zip(rows, owner, strict=True)]
        for rows, owner in zip(files, owners, strict=True)
    ]  # fmt: skip


def run_records(workdir: str) -> tuple[list[dict], list[dict], list[dict]]:
    """The run's metrics, merges and events records, a resumed run's on one clock."""
    files = [_rows(workdir, f"{name}.jsonl") for name in ("metrics", "merges", "events")]
    metrics, merges, events = on_one_clock(files, *_attempts(workdir))
    return metrics, merges, events


def _attempts(workdir: str) -> tuple[list[float] | None, list[int | None] | None]:
    """Each attempt's wall seconds and process id from attempts.jsonl (None: not known)."""
    records = _rows(workdir, "attempts.jsonl")
    seconds = [(r.get("own") if isinstance(r.get("own"), dict) else {}).get("wall_seconds")
               for r in records]  # fmt: skip
    known = records and all(isinstance(x, int | float) for x in seconds)
    pids = [r.get("pid") if isinstance(r.get("pid"), int) else None for r in records]
    return (seconds if known else None), (pids if records else None)


def _marks(ax, events: list[dict]) -> None:
    seen = set()
    for e in events:
        kind = e.get("event")
        if kind not in FAULT_MARKS or (kind == "syncer_restore" and not e.get("after_failure")):
            continue
        colour, label = FAULT_MARKS[kind]
        ax.axvline(
            e["time"],
            color=colour,
            ls="--",
            lw=0.8,
            alpha=0.7,
            label=None if kind in seen else label,
        )
        seen.add(kind)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)


def _merge_panels(a, b, merges: list[dict], events: list[dict]) -> None:
    """Learners per merge and staleness; quorum wait and grace used; over time."""
    t = [r["time"] for r in merges]
    a.plot(t, [len(r["learners"]) for r in merges], ".", ms=3, label="learners / merge")
    stale = [sum(r["staleness"]) / len(r["staleness"]) for r in merges]
    a.plot(t, stale, ".", ms=3, label="mean staleness (versions)")
    b.plot(t, [r["quorum_wait"] for r in merges], ".", ms=3, label="quorum wait (s)")
    b.plot(t, [r["grace"] for r in merges], ".", ms=3, label="grace used (s)")
    a.set_title("merges")
    b.set_title("rounds: waiting for quorum and grace")
    for ax in (a, b):
        _marks(ax, events)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("wall time (s)")
        ax.grid(alpha=0.3)
        _legend(ax)


def _expert_load(fig, ax, moe: list[dict]) -> None:
    import numpy as np

    load = np.array([r["expert_load"] for r in moe])  # [rows, layers, experts]
    extent = (moe[0]["step"], moe[-1]["step"], load.shape[2] - 0.5, -0.5)
    img = ax.imshow(load.mean(axis=1).T, aspect="auto", cmap="viridis", extent=extent)
    fig.colorbar(img, ax=ax, label="share of routed tokens")
    ax.set_xlabel("step")
    ax.set_ylabel("expert (mean over MoE layers)")
    ax.set_title("MoE expert load")


def plot(workdir: str, out: str) -> list[str]:
    """Writes the run's panels into the PNG `out`; returns their titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics, merges, events = run_records(workdir)
    moe = [r for r in metrics if "expert_load" in r]
    panels = 2 + (2 if merges else 0) + (1 if moe else 0)  # no merge panels for DP runs
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2))
    learners = sorted({r["learner"] for r in metrics if isinstance(r["learner"], int)})
    for ax, x in ((axes[0], "tokens"), (axes[1], "time")):
        for m in learners:
            rows = [r for r in metrics if r["learner"] == m and "loss" in r]
            xs = [r[x] / (1e6 if x == "tokens" else 1) for r in rows]
            ax.plot(xs, [r["loss"] for r in rows], lw=0.8, alpha=0.7, label=f"learner {m} train")
        evals = sorted(
            (r[x], r["eval_loss"])
            for r in metrics
            if "eval_loss" in r
            and (r["learner"] == "global" or (len(learners) == 1 and r["learner"] == learners[0]))
        )
        if evals:  # a global row's tokens are every learner's: per learner on this axis
            per = 1e6 * max(len(learners), 1) if x == "tokens" else 1
            xs = [v / per for v, _ in evals]
            ax.plot(xs, [y for _, y in evals], "ko-", ms=3, label="global eval")
        ax.set_xlabel("tokens per learner (millions)" if x == "tokens" else "wall time (s)")
        ax.set_ylabel("loss (nats / token)")
        ax.grid(alpha=0.3)
    _marks(axes[1], events)
    axes[0].set_title("loss vs tokens")
    axes[1].set_title("loss vs wall time (faults marked)")
    _legend(axes[1])
    if merges:
        _merge_panels(axes[2], axes[3], merges, events)
    if moe:
        _expert_load(fig, axes[-1], moe)
    summary = _summary(workdir)
    loss = number(summary.get("final_eval_loss"))
    fig.suptitle(
        f"{summary.get('name', paths.resolve(workdir).name)}: final eval loss "
        f"{float('nan') if loss is None else loss:.4f}"
    )
    fig.tight_layout()
    with paths.resolve(out).open("wb") as f:  # local or gs://
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return [ax.get_title() for ax in axes]


def _summary(workdir: str) -> dict:
    """summary.json's object; {} when there is none (a run not finished); a damaged one is a
    ValueError naming it."""
    path = paths.resolve(workdir) / "summary.json"
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not a JSON object, empty or cut short ({e})") from e
    if not isinstance(summary, dict):
        raise ValueError(f"{path}: holds a JSON {type(summary).__name__}, not an object")
    return summary


def mean_merge_delay(rows: list[dict]) -> float | None:
    """Mean steps from an offer to the boundary applying the merge holding it, over the
    merges of these learner metrics rows (each row's mean weighted by its `merges_held`;
    rows written before that key count once). None: no merge held an offer."""
    held = [(r["merge_delay_steps"], r.get("merges_held", 1)) for r in rows
            if "merge_delay_steps" in r]  # fmt: skip
    n = sum(k for _, k in held)
    return sum(d * k for d, k in held) / n if n else None


def table(workdir: str) -> str:
    """The run's summary and per-learner figures as markdown."""
    s = _summary(workdir)
    keys = (
        "final_eval_loss",
        "steps",
        "tokens",
        "wall_seconds",
        "merges",
        "mean_learners_per_merge",
        "mean_offer_steps",
        "mean_offer_seconds",
        "mean_merge_delay_steps",
        "goodput",
        "uptime",
        "failures",
        "restarts",
        "crash_lost_steps",
        "syncer_lost_steps",
        "resume_lost_steps",
        "rejected_offers",
        "dropped_offers",
        "bytes_per_token",
    )
    lines = ["| summary | value |", "|---|---|"]
    lines += [
        f"| {k} | {s[k]:.4g} |" if isinstance(s[k], float) else f"| {k} | {s[k]} |"
        for k in keys
        if k in s
    ]
    if not s:  # interrupted, or still running: the metrics below are all there is
        lines = ["(no summary.json: the run has not finished; the rows so far follow)"]
    metrics = _rows(workdir, "metrics.jsonl")
    learners = sorted({r["learner"] for r in metrics if isinstance(r["learner"], int)})
    # tokens/s: the median of the rows' rates (each over the steps since the row before:
    # a life's first row holds its compile, a row after an outage its restart; a mean of
    # rates over unequal times weighed fast rows too much). host share / CPU share: medians
    # of the rows' host_share and host_cpu_share (the share of its steps the learner's
    # thread worked on the host instead of waiting for its device, and of that the share it
    # ran on a CPU; runtime/step_times.py).
    head = ("| learner | last step | last train loss | median tokens/s | merge delay (steps) "
            "| host share / CPU share |")  # fmt: skip
    lines += ["", head, "|---|---|---|---|---|---|"]
    for m in learners:
        rows = [r for r in metrics if r["learner"] == m and "loss" in r]
        if not rows:  # evaluation rows only (no runtime writes such a learner)
            continue
        rate = statistics.median(r["tokens_per_second"] for r in rows)
        delay = mean_merge_delay(rows)
        delay = "-" if delay is None else f"{delay:.2f}"
        shares = " / ".join(_median_of(rows, k) for k in ("host_share", "host_cpu_share"))
        lines.append(f"| {m} | {rows[-1]['step']} | {rows[-1]['loss']:.4f} | {rate:,.0f} "
                     f"| {delay} | {shares} |")  # fmt: skip
    merges = _rows(workdir, "merges.jsonl")
    if merges:
        stale = [x for r in merges for x in r["staleness"]]
        wait = sum(r["quorum_wait"] for r in merges) / len(merges)
        grace = sum(r["grace"] for r in merges) / len(merges)
        merge_ms = 1e3 * sum(r.get("merge_seconds", 0.0) for r in merges) / len(merges)
        lines += [
            "",
            "| merges | value |",
            "|---|---|",
            f"| mean staleness (versions) | {sum(stale) / len(stale):.2f} |",
            f"| mean quorum wait (s) | {wait:.3f} |",
            f"| mean grace used (s) | {grace:.3f} |",
            f"| mean merge time (ms) | {merge_ms:.1f} |",
        ]
    return "\n".join(lines) + "\n"


def _median_of(rows: list[dict], key: str) -> str:
    """The median of the rows' `key` to 2 decimals, "-" where no row has it (runs written
    before the key existed)."""
    values = [r[key] for r in rows if key in r]
    return f"{statistics.median(values):.2f}" if values else "-"


def outputs(workdir: str, out: str | None) -> tuple[str, str]:
    """(PNG, table) paths of the report `out` names (None: <workdir>/report): a .png or .md
    suffix is taken off it and each added, so the two are never one file. A ValueError
    naming --out when one could not be written there (a folder, a missing one)."""
    base = out or f"{workdir}/report"
    if base.lower().endswith((".png", ".md")):
        base = base[: base.rfind(".")]
    if out and (base.endswith("/") or paths.resolve(out).is_dir()):
        raise ValueError(f"--out={out} is a folder: give the report's name in it, e.g. "
                         f"--out={out.rstrip('/')}/report.png")  # fmt: skip
    png, md = paths.resolve(base + ".png"), paths.resolve(base + ".md")
    folder = png.parent
    if not folder.exists():
        raise ValueError(f"--out={out}: its folder {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"--out={out}: {folder} is a file, not a folder")
    for path in (png, md):
        if path.is_dir():
            raise ValueError(f"--out={out}: {path} is a folder")
    return str(png), str(md)


def main(argv) -> None:
    cli.refuse_stray_arguments(argv)
    FLAGS = flags.FLAGS
    if not FLAGS.workdir:
        sys.exit("usage: python -m decoupled_diloco.report --workdir=DIR [--out=PATH.png]")
    if not (paths.resolve(FLAGS.workdir) / "metrics.jsonl").exists():
        sys.exit(f"error: {FLAGS.workdir} holds no run (no metrics.jsonl)")
    try:
        png, md = outputs(FLAGS.workdir, FLAGS.out)
        text = table(FLAGS.workdir)  # first: a damaged run file leaves no PNG behind
        plot(FLAGS.workdir, png)
        paths.resolve(md).write_text(text)
    except ValueError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # no permission, a full disk
        sys.exit(f"error: --out={FLAGS.out}: cannot write {e.filename or ''} ({e.strerror or e})")
    print(text + f"\nwrote {png} and {md}", flush=True)


def _define_flags() -> None:
    flags.DEFINE_string("workdir", None, "The run's workdir.")
    flags.DEFINE_string(
        "out",
        None,
        "Where to write the report: PATH.png (the plots) and PATH.md (the table); a .png or "
        ".md ending of --out is taken off first (default: <workdir>/report.png and report.md).",
    )


if __name__ == "__main__":
    cli.run(main, _define_flags)
