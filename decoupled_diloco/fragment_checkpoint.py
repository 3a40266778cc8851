"""Syncer checkpoints written one fragment at a time, committed by a manifest.

A syncer's state is Θ and the outer momenta of every fragment it owns (2× the model in
fp32: ~17 GB for the dense 2B config, ~125 GB for the MoE one). Copying all of it to write
one orbax item would double the syncer's memory and hold the merge lock for the whole copy.
Here a save is streamed: the syncer loop copies one fragment under its lock and hands it to
`write_fragment`, which writes it while merges of every fragment go on; `commit` then
writes the manifest. Peak extra memory: one fragment's Θ + momentum (orbax is told not to
copy host arrays again; the checksums read in 64k-element chunks, integrity.py).

Layout under `syncer_<s>/`:
    <n>/arrays/fragment_<p>/theta, .../momentum   orbax PyTrees {leaf name: array}
    <n>/manifest.json          written last: a step without it was never committed
The manifest holds the syncer's JSON state (plan, registry, counters, event-log position)
and, per fragment, what was copied with its arrays under the same lock: version, schedule
slot, vector clock, and the arrays' checksums. That per-fragment cut is what a restore
needs: a fragment's Θ, momentum, version and clock always agree with each other; different
fragments may be cut at different moments, exactly as a live syncer merges them at
different moments (learners meet each fragment's clock on its own, learner.py `_resync`).

Trust no byte, as checkpoint.py: a step whose manifest or any fragment fails its checks is
reported, moved aside to `<checkpoints>/corrupt/` and the previous committed step tried.
"""

import json
import logging
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from decoupled_diloco import integrity, paths
from decoupled_diloco.checkpoint import (
    CorruptCheckpointError,
    quiet_failed_read_leftovers,
    set_aside,
)

MANIFEST = "manifest.json"


def _writer() -> ocp.Checkpointer:
    """A synchronous orbax PyTree checkpointer that writes host arrays without copying them
    first (orbax's default deep-copies them, doubling a fragment's footprint): the arrays
    it is given are the syncer loop's private copies, which nothing else changes."""
    th = ocp.type_handlers
    try:
        numpy_handler = th.NumpyHandler(deepcopy_host_arrays=False)
    except TypeError:  # an orbax release without the option: its default handler
        numpy_handler = th.NumpyHandler()
    registry = th.create_type_handler_registry(
        (np.ndarray, numpy_handler),
        (np.number, th.ScalarHandler()),
        (jax.Array, th.ArrayHandler()),
    )
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))


class FragmentCheckpointer:
    """Numbered, streamed checkpoints of one syncer shard (`read_only`: never changes the
    directory, a refused step raises instead of being moved aside)."""

    def __init__(self, directory: str, max_to_keep: int = 2, read_only: bool = False):
        self.path = paths.resolve(directory)  # local: absolute; gs://...: as it is
        self.directory = str(self.path)
        self.max_to_keep, self.read_only = max_to_keep, read_only
        self.refused: list[tuple[int, str, str | None]] = []  # (step, reason, moved to), as
        # Checkpointer. Steps refused that could not be moved aside: never kept in place of
        # a good one (`commit` counts max_to_keep over the others).
        self._unusable: set[int] = set()
        self._lock = threading.Lock()  # the loop's saver thread vs. its restores
        self._orbax = _writer()
        if not read_only:
            self.path.mkdir(parents=True, exist_ok=True)

    # --- steps ------------------------------------------------------------------------
    def _numbered(self) -> list[int]:
        if not self.path.exists():
            return []
        return sorted(int(d.name) for d in self.path.iterdir() if d.name.isdigit())

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return [n for n in self._numbered() if (self.path / str(n) / MANIFEST).exists()]

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --- saving -----------------------------------------------------------------------
    def begin(self) -> int:
        """The number of a new step; leftovers of saves that never committed (the process
        died, or the syncer's life ended mid-save) are removed first."""
        with self._lock:
            committed = set(self.all_steps())
            for n in self._numbered():
                if n not in committed:
                    (self.path / str(n)).rmtree()
            return max(committed, default=0) + 1

    def write_fragment(self, n: int, p: int, arrays: dict, info: dict) -> dict | None:
        """Writes fragment p's {"theta", "momentum"} of step n; returns its manifest entry
        (`info` sealed with the arrays' checksums), or None (logged) when they are not
        finite: such a state is never saved."""
        try:
            entry = integrity.seal(arrays, info)
        except ValueError as e:
            logging.error("%s: step %d fragment %d not saved: %s", self.directory, n, p, e)
            return None
        for part, tree in arrays.items():  # apart: Θ can be read without the momenta
            self._orbax.save(self.path / str(n) / "arrays" / f"fragment_{p}" / part,
                             args=ocp.args.PyTreeSave(tree), force=True)  # fmt: skip
        return entry

    def commit(self, n: int, fragments: dict[int, dict], meta: dict) -> None:
        """Writes step n's manifest (its commit) and drops steps beyond `max_to_keep`."""
        entries = {str(p): e for p, e in fragments.items()}
        body = integrity.seal({}, {"meta": meta, "fragments": entries})
        text = json.dumps(body)
        target = self.path / str(n) / MANIFEST
        if "://" in self.directory:  # an object store writes one object atomically
            target.write_text(text)
        else:  # a file system: a half-written manifest must never be seen
            tmp = target.with_name(MANIFEST + ".tmp")
            tmp.write_text(text)
            tmp.rename(target)
        with self._lock:
            usable = [s for s in self.all_steps() if s not in self._unusable]
            for old in usable[: -self.max_to_keep]:
                (self.path / str(old)).rmtree()

    # --- restoring --------------------------------------------------------------------
    def read(self, n: int, momentum: bool = True) -> tuple[dict[int, tuple[dict, dict]], dict]:
        """Step n as ({p: (arrays, info)}, meta); CorruptCheckpointError if any check fails
        (`momentum=False`: Θ only, for evaluation and export)."""
        step = self.path / str(n)
        try:
            body = json.loads((step / MANIFEST).read_text())
        except Exception as e:  # unreadable is refused like bad bytes
            why = f"{step}: unreadable manifest ({type(e).__name__}: {e})"
            raise CorruptCheckpointError(why) from e
        reason = integrity.check_meta(body) or _shape_error(body)
        if reason:
            raise CorruptCheckpointError(f"{step}: manifest {reason}")
        out, parts = {}, ("theta", "momentum") if momentum else ("theta",)
        quiet_failed_read_leftovers()
        for p, entry in sorted(body["fragments"].items(), key=lambda kv: int(kv[0])):
            try:
                arrays = {part: self._orbax.restore(step / "arrays" / f"fragment_{p}" / part)
                          for part in parts}  # fmt: skip
                reason = integrity.check(arrays, entry, partial=not momentum)
            except Exception as e:
                reason = f"unreadable ({type(e).__name__}: {str(e)[:200]})"
            if reason:
                raise CorruptCheckpointError(f"{step}: fragment {p}: {reason}")
            out[int(p)] = (arrays, {k: v for k, v in entry.items() if k != integrity.KEY})
        return out, body["meta"]

    def restore(self, step: int | None = None) -> tuple[dict[int, tuple[dict, dict]], dict]:
        """The newest committed step (at or before `step`) that verifies; the newer steps it
        refused are moved aside (and listed in `refused`). CorruptCheckpointError when none
        verifies: then every step stays where it is, so a retry fails alike instead of
        finding no checkpoint and starting afresh."""
        with self._lock:
            candidates = [s for s in reversed(self.all_steps()) if step is None or s <= step]
            if not candidates:
                raise FileNotFoundError(f"{self.directory}: no checkpoint at or before {step}")
            refused = []
            for s in candidates:
                try:
                    out = self.read(s)
                except CorruptCheckpointError as e:
                    refused.append((s, str(e)))
                    continue
                if not self.read_only:
                    for bad, why in refused:
                        reason = why.split(": ", 1)[1]
                        moved = set_aside(self.path / str(bad), reason)
                        self.refused.append((bad, reason, moved))
                        if moved is None:
                            self._unusable.add(bad)
                return out
        raise CorruptCheckpointError(
            "no kept checkpoint step can be trusted: " + "; ".join(why for _, why in refused)
        )

    def close(self) -> None:
        self._orbax.close()


def _shape_error(body: Any) -> str:
    ok = isinstance(body, dict) and isinstance(body.get("fragments"), dict) and "meta" in body
    return "" if ok else "is not a syncer manifest"
