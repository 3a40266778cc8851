"""Fragment members: whole leaves, or row slices of the embedding (fragments.py).

A balanced plan at large P would leave the embedding, by far the largest leaf (590M of
gemma_2b's 2.6B parameters), as one fragment 5x the others: the fragment due at its step
would carry 5x the mean traffic. Instead the embedding gets k fragments of row slices
"<leaf>[<start>:<stop>]" (rows start..stop-1 of the leaf's first axis). Only the embedding
is cut, only into fragments of its own, and only under an elementwise merge rule (the
weighted mean), so merging each slice is merging the leaf: the merge stays per leaf.
"""

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

_SLICE_RE = re.compile(r"^(.+)\[(\d+):(\d+)\]$")
ROW_ALIGN = 128  # slice boundaries are multiples of this many rows (where the leaf allows)


def parse_member(name: str) -> tuple[str, slice | None]:
    """(leaf, rows) of a fragment member: rows is None for a whole leaf."""
    m = _SLICE_RE.match(name)
    return (m.group(1), slice(int(m.group(2)), int(m.group(3)))) if m else (name, None)


def slice_member(leaf: str, start: int, stop: int) -> str:
    return f"{leaf}[{start}:{stop}]"


def join_members(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Member-keyed arrays (e.g. Θ from the syncer) -> whole leaves, keys sorted: the row
    slices of a leaf are concatenated (they must cover it from row 0, without gaps)."""
    out, pieces = {}, {}
    for name, value in flat.items():
        leaf, rows = parse_member(name)
        if rows is None:
            out[leaf] = value
        else:
            pieces.setdefault(leaf, []).append((rows.start, rows.stop, value))
    for leaf, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        ends = [0] + [stop for _, stop, _ in parts[:-1]]
        if leaf in out or [start for start, _, _ in parts] != ends:
            raise ValueError(f"join_members: the row slices of {leaf!r} do not tile it")
        out[leaf] = np.concatenate([np.asarray(v) for _, _, v in parts], axis=0)
    return dict(sorted(out.items()))


def _shape(shape: Any) -> tuple[int, ...]:
    return tuple(getattr(shape, "shape", shape))


def member_size(name: str, shapes: Mapping[str, Any]) -> int:
    """Elements of a member (a leaf of `shapes`, or a row slice of one)."""
    leaf, rows = parse_member(name)
    shape = _shape(shapes[leaf])
    if rows is None:
        return math.prod(shape)
    return (rows.stop - rows.start) * math.prod(shape[1:])


def embedding_fragments(sizes: dict, embedding: list[str], rest: dict, num_fragments: int) -> int:
    """k: fragments for the embedding leaves so that they and the other leaves' bins are
    about equally big: the k minimising max(E / k, R / (P − k)) (the smallest on ties)."""
    emb, other = sum(sizes[n] for n in embedding), sum(rest.values())
    if not rest:
        return 1
    choices = range(1, num_fragments)
    choices = [k for k in choices if num_fragments - k <= len(rest)] or [1]
    return min(choices, key=lambda k: (max(emb / k, other / (num_fragments - k)), k))


def embedding_groups(shapes, embedding: list[str], k: int, bin_pack) -> list[list[str]]:
    """The embedding leaves cut into row slices of about 1/k of their total size (slice
    boundaries on multiples of ROW_ALIGN rows where the leaf allows) and bin-packed into
    k groups."""
    sizes = {n: math.prod(_shape(shapes[n])) for n in embedding}
    piece = sum(sizes.values()) / k
    items = []
    for name in embedding:
        rows = _shape(shapes[name])[0]
        cuts = max(1, math.ceil(sizes[name] / piece - 1e-9))
        if cuts == 1 or rows < 2:
            items.append((name, sizes[name]))
            continue
        align = math.gcd(rows, ROW_ALIGN)
        bounds = sorted({round(i * rows / cuts / align) * align for i in range(cuts)} | {rows})
        row_size = sizes[name] // rows
        pairs = zip(bounds[:-1], bounds[1:], strict=True)
        items += [(slice_member(name, a, b), (b - a) * row_size) for a, b in pairs]
    return bin_pack(items, k)
