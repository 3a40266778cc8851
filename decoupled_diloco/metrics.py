"""Run outputs: metrics.jsonl, merges.jsonl, events, summary.json and the console progress line."""

import contextlib
import json
import math
import sys
import threading
import time

from absl import logging

from decoupled_diloco import paths


def _clean(x):
    """`x` as strict JSON data: a non-finite float as its str ("nan", "inf", "-inf", which
    report.number reads back), at any depth and inside arrays too (json.dumps would write
    the NaN and Infinity no JSON parser but Python's accepts)."""
    if hasattr(x, "tolist"):  # numpy and jax arrays and scalars (a np.float32 is no float)
        x = x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _dumps(record: dict, **kwargs) -> str:
    return json.dumps(_clean(record), allow_nan=False, **kwargs)


def parse_jsonl(text: str, name: str) -> list[dict]:
    """The records of a JSON-lines file's `text`. A last line cut short (no newline after
    it: a process killed while writing it) is left out; any other line that is not a record
    is a ValueError naming the file and line."""
    lines = text.split("\n")
    torn = lines.pop() if lines else ""  # what follows the last newline: "" or a torn line
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: line {i} is not a JSON record ({e})") from e
    if torn.strip():
        with contextlib.suppress(json.JSONDecodeError):  # else cut short: left out
            records.append(json.loads(torn))  # complete, only its newline missing
    return records


def read_jsonl(path) -> list[dict]:
    """`parse_jsonl` of the file at `path` (local or remote); [] when there is none."""
    path = paths.resolve(path)
    return parse_jsonl(path.read_text(), str(path)) if path.exists() else []


class JsonlWriter:
    """Thread-safe append-only JSON-lines file (one object per line), local or remote
    (paths.AppendFile: flushed per line locally, uploaded every few seconds remotely). A
    last line cut short by a killed process is dropped before anything is appended (as
    `parse_jsonl` leaves it out), so it cannot run into the next record."""

    def __init__(self, path: str):
        self._file = paths.AppendFile(path)
        self._lock = threading.Lock()
        self._name = str(path)
        content = self._file.content()
        end = content.rfind(b"\n") + 1
        if end < len(content):  # something after the last newline
            try:
                json.loads(content[end:])  # a whole record, only its newline lost: kept
                self._file.append(b"\n")
            except ValueError:
                logging.warning(
                    "%s: its last line was cut short (a process killed while writing it): "
                    "dropped %d bytes",
                    path,
                    len(content) - end,
                )
                self._file.replace_content(content[:end])

    def write(self, record: dict) -> None:
        line = _dumps(record)
        with self._lock:
            self._file.append((line + "\n").encode())

    def retain(self, keep) -> int:
        """Drops the lines whose record fails `keep(record)` (e.g. steps a resumed run will
        redo); returns how many were dropped."""
        with self._lock:
            records = parse_jsonl(self._file.content().decode(), self._name)
            kept = [r for r in records if keep(r)]
            self._file.replace_content("".join(_dumps(r) + "\n" for r in kept).encode())
        return len(records) - len(kept)

    def count(self) -> int:
        """Records in the file, those of earlier attempts of the run included."""
        with self._lock:
            return sum(1 for ln in self._file.content().decode().splitlines() if ln.strip())

    def close(self) -> None:
        with self._lock:
            self._file.close()


def write_json(path: str, obj: dict) -> None:
    text = _dumps(obj, indent=2, sort_keys=True)
    paths.write_atomic(path, text)


class Progress:
    """A single refreshing console line (a plain line per update when not a TTY)."""

    def __init__(self, total_steps: int, stream=sys.stderr, learners: int = 1):
        self.total, self.stream, self.t0 = total_steps, stream, time.monotonic()
        self.tty = stream.isatty()
        self.learners = learners
        self._lock = threading.Lock()
        self._lead = -1  # the step of the leading learner's last row

    def learner_row(self, learner, step: int, text: str) -> None:
        """Learner `learner`'s row at `step`: the line follows whichever learner leads, so
        one that is down or slow does not stop it."""
        if step < self._lead:
            return
        self._lead = step
        self.update(step, text if self.learners == 1 else f"learner {learner} {text}")

    def update(self, step: int, text: str) -> None:
        frac = min(step / max(self.total, 1), 1.0)
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        elapsed = time.monotonic() - self.t0
        line = f"[{bar}] {step}/{self.total} {elapsed:6.1f}s {text}"
        with self._lock:
            if self.tty:
                self.stream.write("\r" + line[:160].ljust(160))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
