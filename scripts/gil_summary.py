r"""Who holds the interpreter lock: a summary of a py-spy recording of a run.

    py-spy record --gil --nonblocking --rate 200 --format raw -o gil.txt -- \
        python -m decoupled_diloco.main --config=configs/tiny_decoupled.py ...
    python scripts/gil_summary.py gil.txt --seconds=60 --rate=200

A run's threads (learners, their data readers, outboxes and stagers, the syncer and its merge
threads) share one interpreter. `py-spy record --gil` samples only the thread holding its
lock, so each sample is a moment the lock was taken and by what. This groups the samples by
the thread's role (the first frame of the stack that names one, `ROLES`) and prints, per
role, its samples as a share of all of them and, with --seconds and --rate, of the
recording's wall time (the lock's busy share: near 1, a thread that wants it waits), then
each role's heaviest call paths: the --depth frames below the role's own.

py-spy's raw format: one line per distinct stack, frames from the thread's root to the leaf
separated by ";", then a space and the sample count. With --threads a first frame names the
thread; it is skipped like any frame that names no role.
"""

import collections
import sys

from absl import app, flags

from decoupled_diloco import cli

_SECONDS = flags.DEFINE_float("seconds", None, "The recording's duration (for shares of it).")
_RATE = flags.DEFINE_float("rate", None, "py-spy's --rate (samples per second).")
_TOP = flags.DEFINE_integer("top", 6, "Call paths listed per role.")
_DEPTH = flags.DEFINE_integer("depth", 3, "Frames per call path.")

# (role, function, file): a frame of that function (with or without its class: py-spy
# before 0.4.3 prints bare names) in that file makes a stack that role's, first match from
# the root; "" matches any. Files are matched by their last path component.
ROLES = (
    ("learner", "_train", "learner_loop.py"),
    ("learner (ray)", "", "ray/learner.py"),
    ("data prefetch", "_read", "prefetch.py"),
    ("outbox", "_loop", "outbox.py"),
    ("merge stager", "_place", "boundary.py"),
    ("syncer checkpoint", "_save_or_keep_error", "syncer_loop.py"),
    ("syncer", "serve_turn", "syncer_loop.py"),
    ("syncer", "run", "syncer_loop.py"),
    ("merge threads", "span", "outer.py"),
    ("merge threads", "map_spans", "chunks.py"),
    ("syncer process link", "", "syncer_process.py"),
    ("lock probe", "_run", "gil.py"),
    ("metrics sink", "", "records.py"),
    ("main thread", "<module>", ""),
    ("main thread", "clean_up", ""),
    # Stacks py-spy cut short (no thread root): JAX tracing or compiling, mostly start-up.
    ("jax tracing, compiling", "_pjit_lower", ""),
    ("jax tracing, compiling", "process_primitive", ""),
    ("jax tracing, compiling", "compile", ""),
)


def _name(frame: str) -> str:
    """'Outbox._loop (decoupled_diloco/runtime/outbox.py:102)' -> 'Outbox._loop'."""
    return frame.split(" (", 1)[0].strip()


def _file(frame: str) -> str:
    """'Outbox._loop (decoupled_diloco/runtime/outbox.py:102)' -> '.../outbox.py'."""
    where = frame.rpartition(" (")[2].rstrip(")")
    return where.rsplit(":", 1)[0]


def _matches(frame: str, function: str, file: str) -> bool:
    name = _name(frame)
    if function and name != function and not name.endswith("." + function):
        return False
    return not file or _file(frame).endswith(file)


def read(path: str) -> list[tuple[list[str], int]]:
    """(frames root first, samples) per line of a py-spy raw file."""
    stacks = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                raise ValueError(f"{path}:{number}: not py-spy raw output ('a;b;c COUNT'): "
                                 f"{line[:120]!r}")  # fmt: skip
            # An empty stack: the lock held with no Python frame (native code, start-up).
            stacks.append((stack.split(";") if stack.strip() else [], int(count)))
    return stacks


def role(frames: list[str]) -> tuple[str, int]:
    """The stack's role and the index of the frame that named it ('other', -1: none)."""
    for i, frame in enumerate(frames):
        for label, function, file in ROLES:
            if _matches(frame, function, file):
                return label, i
    return "other", -1


def summarize(stacks, seconds: float | None = None, rate: float | None = None, top: int = 6,
              depth: int = 3):  # fmt: skip
    """Lines of the report (module doc)."""
    by_role: collections.Counter = collections.Counter()
    below: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for frames, n in stacks:
        label, i = role(frames)
        by_role[label] += n
        # The `depth` frames below the role's own (a stack of no role: its last ones).
        if not frames:
            below[label]["(no Python frame)"] += n
            continue
        path = frames[i + 1 : i + 1 + depth] if i >= 0 else frames[-depth:]
        below[label][" > ".join(_name(f) for f in path) or _name(frames[i])] += n
    total = sum(by_role.values())
    possible = seconds * rate if seconds and rate else None
    lines = [f"{total} samples with the interpreter lock held"
             + (f" of {possible:.0f} taken ({total / possible:.1%} of the wall time)"
                if possible else "")]  # fmt: skip
    lines.append(f"{'role':<22} {'samples':>8} {'of held':>8}" + (f" {'of wall':>8}" if possible
                                                                  else ""))  # fmt: skip
    for label, n in by_role.most_common():
        wall = f" {n / possible:>8.1%}" if possible else ""
        lines.append(f"{label:<22} {n:>8} {n / total:>8.1%}{wall}")
    for label, n in by_role.most_common():
        lines.append(f"\n{label}: heaviest call paths ({n} samples)")
        for name, k in below[label].most_common(top):
            lines.append(f"  {k:>7} {k / total:>7.1%}  {name}")
    return lines


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("one argument: the py-spy record --format raw output")
    try:
        stacks = read(argv[1])
    except (OSError, ValueError) as e:
        print(f"gil_summary: {e}", file=sys.stderr)
        return 2
    if not stacks:
        print(f"gil_summary: {argv[1]} holds no samples", file=sys.stderr)
        return 2
    print("\n".join(summarize(stacks, _SECONDS.value, _RATE.value, _TOP.value, _DEPTH.value)))
    return 0


if __name__ == "__main__":
    cli.run_script(main)
