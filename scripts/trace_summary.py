r"""What a `--profile` trace says, without TensorBoard: device busy time and thread by thread.

    python -m decoupled_diloco.main ... --profile=120:128 --workdir=W
    python scripts/trace_summary.py W            # or a .trace.json.gz file
    python scripts/trace_summary.py W --top=10

Reads the Chrome-format trace (`*.trace.json.gz`) `jax.profiler` writes beside its
`.xplane.pb` and prints, over the traced window:
- per device plane (`/device:GPU:0`, ...): the share of the window its streams were busy
  (the union of their events); well below 1 with the learner's thread busy, the device
  starves (a host-bound learner);
- per host thread: its role, read off the project modules its Python events come from
  (`ROLES`; XLA's own threads by their names), its busy share of the window, and the
  runtime's heaviest events on it (dispatch, `Wait for ...` holds, transfers) and the
  heaviest Python functions, by total duration (nested events count in each of theirs).
  Busy is time inside some event of the thread but not inside a blocking Python call (a
  lock, a queue, a sleep, a join: `WAITS`); time blocked inside the runtime (a transfer, a
  `Wait for ...` hold) counts as busy and shows in the thread's runtime events.

The Python events (named "$file.py:line function") exist when the trace's Python tracer is
on (jax.profiler's default). Every duration is in milliseconds.
"""

import collections
import gzip
import json
import pathlib
import sys
import zlib

from absl import app, flags

from decoupled_diloco import cli

_TOP = flags.DEFINE_integer("top", 6, "Events and functions listed per thread.")
_MIN_SHARE = flags.DEFINE_float(
    "min_share", 0.01, "Threads busy less than this share of the window are left out."
)

# (module, function or "" for any) -> the role of a thread, first match; a thread takes the
# role of its longest Python event that matches one (its outermost loop in the window).
ROLES = (
    ("boundary.py", "_place", "merge stager"),
    ("boundary.py", "_rebase", "merge stager"),
    ("replica.py", "_compile_fragment", "precompile"),
    ("outbox.py", "", "outbox"),
    ("prefetch.py", "", "data prefetch"),
    ("iterator.py", "", "data prefetch"),
    ("windows.py", "", "data prefetch"),
    ("order.py", "", "data prefetch"),
    ("learner_loop.py", "", "learner"),
    ("boundary.py", "", "learner"),
    ("replica.py", "", "learner"),
    ("fragment_ops.py", "", "learner"),
    ("learner.py", "", "learner"),
    ("profiling.py", "", "learner"),
    ("syncer_loop.py", "", "syncer"),
    ("syncer.py", "", "syncer"),
    ("rounds.py", "", "syncer"),
    ("merge.py", "", "syncer"),
    ("outer.py", "", "merge threads"),
    ("chunks.py", "", "merge threads"),
    ("fragment_checkpoint.py", "", "checkpoint"),
    ("gil.py", "", "lock probe"),
)


def find_trace(path: str) -> pathlib.Path:
    """The newest *.trace.json.gz at `path` (a file, a workdir or its profile folder)."""
    p = pathlib.Path(path)
    if p.is_file():
        return p
    found = sorted(p.rglob("*.trace.json.gz"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {p} (a run with --profile writes one)")
    return found[-1]


def load_trace(path: pathlib.Path) -> dict:
    """The Chrome trace in the gzipped file `path` as its object form: the JSON array form
    (a list of events, also valid Chrome trace format) becomes {"traceEvents": [...]}. A
    file cut short or not a trace is a ValueError naming it."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # (a profile still being written)
        raise ValueError(f"{path}: not a whole gzip file, cut short or damaged ({e})") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not a JSON trace ({e})") from e
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents", []), list):
        raise ValueError(f"{path}: not a Chrome trace (an object with traceEvents or a list)")
    if not all(isinstance(e, dict) for e in trace.get("traceEvents", [])):
        raise ValueError(f"{path}: a trace event that is not a JSON object")
    return trace


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# Python functions that block (a thread inside them waits for another, or for time); a
# builtin's (the tracer's "<unknown>" module) `__enter__` is a `with lock:` taking the lock.
WAITS = ("wait", "get", "put", "acquire", "join", "_wait_for_tstate_lock", "sleep", "result",
         "select", "poll")  # fmt: skip


def _waiting(name: str) -> bool:
    """A Python event ("$file.py:line function") that blocks: a lock, queue, sleep, join."""
    if not name.startswith("$"):
        return False
    function = name.rsplit(" ", 1)[-1]
    if function == "__enter__":
        return "<unknown>" in name
    return function in WAITS and (
        "<unknown>" in name or "threading.py" in name or "queue.py" in name or "time" in name
        or "_base.py" in name or "selectors.py" in name
    )  # fmt: skip


def _module_function(name: str) -> tuple[str, str]:
    """'$decoupled_diloco/runtime/outbox.py:87 _make' -> ('outbox.py', '_make')."""
    where, _, function = name[1:].rpartition(" ")
    return where.split(":", 1)[0].rsplit("/", 1)[-1], function


def _role(functions: collections.Counter, thread_name: str) -> str:
    """The role of the thread's longest Python event that names one (`ROLES`): its
    outermost loop in the window (an outbox's thread also runs the replica's code)."""
    best, role = -1.0, None
    for name, dur in functions.items():
        module, function = _module_function(name)
        for m, f, label in ROLES:
            if module == m and (not f or function == f):
                if dur > best:
                    best, role = dur, label
                break
    return role or thread_name or "?"


def summarize(trace: dict, top: int = 6, min_share: float = 0.01) -> list[str]:
    """Lines of the report (module doc) for a loaded Chrome trace."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not events:
        return ["the trace holds no timed events"]
    process, thread = {}, {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e.get("args", {}).get("name", str(e["pid"]))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    start = min(e["ts"] for e in events)
    window = max(e["ts"] + e["dur"] for e in events) - start
    if window <= 0:
        return [f"the trace's {len(events)} timed events span no time"]
    by_line: dict[tuple, list] = collections.defaultdict(list)
    for e in events:
        by_line[(e["pid"], e.get("tid"))].append(e)
    lines = [f"window {window / 1e3:.1f} ms"]
    devices = sorted({pid for pid, _ in by_line if "/device:" in process.get(pid, "")})
    for pid in devices:
        spans = [(e["ts"], e["ts"] + e["dur"]) for (p, _), es in by_line.items() if p == pid
                 for e in es]  # fmt: skip
        streams = sum(1 for p, _ in by_line if p == pid)
        lines.append(f"{process[pid]}: busy {_union(spans) / window:.1%} of the window "
                     f"({streams} streams/lines)")  # fmt: skip
    rows = []
    for (pid, tid), es in by_line.items():
        if pid in devices:
            continue
        # Busy: inside some event and not inside a blocking Python call (waits nest inside
        # the functions that call them, so this is the union minus the waits' union).
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in es]
        waits = [(e["ts"], e["ts"] + e["dur"]) for e in es if _waiting(e["name"])]
        busy = (_union(spans) - _union(waits)) / window
        if busy < min_share:
            continue
        runtime, functions = collections.Counter(), collections.Counter()
        for e in es:
            (functions if e["name"].startswith("$") else runtime)[e["name"]] += e["dur"]
        role = _role(functions, thread.get((pid, tid), ""))
        rows.append((busy, role, tid, runtime, functions, len(es)))
    for busy, role, tid, runtime, functions, n in sorted(rows, key=lambda r: -r[0]):
        lines.append(f"\n{role} (thread {tid}): busy {busy:.1%} of the window, {n} events")
        for name, dur in runtime.most_common(top):
            lines.append(f"  {dur / 1e3:>9.2f} ms  {name}")
        if functions:
            lines.append("  Python (inclusive):")
            for name, dur in functions.most_common(top):
                lines.append(f"  {dur / 1e3:>9.2f} ms  {name[1:]}")
    return lines


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("one argument: a run's workdir, its profile folder or a trace file")
    try:
        path = find_trace(argv[1])
        trace = load_trace(path)
    except (OSError, ValueError) as e:
        print(f"trace_summary: {e}", file=sys.stderr)
        return 2
    print(f"{path}")
    print("\n".join(summarize(trace, _TOP.value, _MIN_SHARE.value)))
    return 0


if __name__ == "__main__":
    cli.run_script(main)
