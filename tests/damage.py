"""Bad bytes in a checkpoint's stored values, as a failing disk would leave them, for the
tests that check a damaged step is refused.

Where to flip matters. orbax stores an item (a directory holding `manifest.ocdbt`) as an
OCDBT database: its values in `ocdbt.process_<i>/d/`, and after the save a merged b-tree in
the item's own `d/`. The per-process b-tree files written beside the values are not read by
a restore, and which data file ends up the largest varies from save to save, so flipping
"the middle of the largest file" sometimes damaged bytes nothing reads (CI saw such a
corrupted step restore cleanly). `flip_values` flips the middle of every file of values and
checks, with a plain orbax read, that the damage shows.
"""

import pathlib
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp


def _items(step_dir: pathlib.Path) -> list[pathlib.Path]:
    manifests = step_dir.rglob("manifest.ocdbt")
    return sorted(m.parent for m in manifests if not m.parent.name.startswith("ocdbt.process_"))


def _read(item: pathlib.Path):
    """The item's leaves as host arrays (whatever devices it was saved from), or the error
    a plain orbax read raises."""
    reader = ocp.PyTreeCheckpointer()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = reader.metadata(item).item_metadata.tree
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            tree = reader.restore(item, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    except Exception as e:  # damage that makes the item unreadable shows too
        return repr(e)
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return len(a) == len(b) and all(
        x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True)
    )


def flip_values(step_dir, count: int = 64) -> None:
    """Inverts `count` bytes in the middle of every value file of every orbax item under
    `step_dir`; fails the test if no item reads back different (the damage missed)."""
    step_dir = pathlib.Path(step_dir)
    items = _items(step_dir)
    assert items, f"{step_dir}: no orbax item (manifest.ocdbt) to damage"
    before = {item: _read(item) for item in items}
    for item in items:
        for path in sorted(item.glob("ocdbt.process_*/d/*")):
            with open(path, "r+b") as f:
                raw = bytearray(f.read())
                start = max(0, len(raw) // 2 - count // 2)
                for i in range(start, min(len(raw), start + count)):
                    raw[i] ^= 0xFF
                f.seek(0)
                f.write(raw)
    missed = [item for item in items if _same(before[item], _read(item))]
    assert len(missed) < len(items), f"flipped bytes in {step_dir} that no read sees"
