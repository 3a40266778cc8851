"""Run outputs: metrics.jsonl, merges.jsonl, events, summary.json and the console progress line."""

import json
import math
import os
import sys
import threading
import time


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if hasattr(x, "tolist"):
        return x.tolist()
    return x


class JsonlWriter:
    """Thread-safe append-only JSON-lines file (one object per line, flushed per line)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()})
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def retain(self, keep) -> int:
        """Drops the lines whose record fails `keep(record)` (e.g. steps a resumed run will
        redo); returns how many were dropped."""
        with self._lock:
            self._f.close()
            path = self._f.name
            with open(path, encoding="utf-8") as f:
                lines = [line for line in f if line.strip()]
            kept = [line for line in lines if keep(json.loads(line))]
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, path)
            self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115
        return len(lines) - len(kept)

    def close(self) -> None:
        with self._lock:
            self._f.close()


def write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({k: _clean(v) for k, v in obj.items()}, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


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
