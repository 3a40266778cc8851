"""Run outputs: metrics.jsonl, merges.jsonl, events, summary.json and the console progress line."""

import json
import math
import sys
import threading
import time

from decoupled_diloco import paths


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if hasattr(x, "tolist"):
        return x.tolist()
    return x


class JsonlWriter:
    """Thread-safe append-only JSON-lines file (one object per line), local or remote
    (paths.AppendFile: flushed per line locally, uploaded every few seconds remotely)."""

    def __init__(self, path: str):
        self._file = paths.AppendFile(path)
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()})
        with self._lock:
            self._file.append((line + "\n").encode())

    def retain(self, keep) -> int:
        """Drops the lines whose record fails `keep(record)` (e.g. steps a resumed run will
        redo); returns how many were dropped."""
        with self._lock:
            lines = [ln for ln in self._file.content().decode().splitlines() if ln.strip()]
            kept = [ln + "\n" for ln in lines if keep(json.loads(ln))]
            self._file.replace_content("".join(kept).encode())
        return len(lines) - len(kept)

    def count(self) -> int:
        """Records in the file, those of earlier attempts of the run included."""
        with self._lock:
            return sum(1 for ln in self._file.content().decode().splitlines() if ln.strip())

    def close(self) -> None:
        with self._lock:
            self._file.close()


def write_json(path: str, obj: dict) -> None:
    text = json.dumps({k: _clean(v) for k, v in obj.items()}, indent=2, sort_keys=True)
    paths.write_atomic(path, text)


class Progress:
    """A single refreshing console line (a plain line per update when not a TTY)."""

    def __init__(self, total_steps: int, stream=sys.stderr):
        self.total, self.stream, self.t0 = total_steps, stream, time.monotonic()
        self.tty = stream.isatty()
        self._lock = threading.Lock()

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
