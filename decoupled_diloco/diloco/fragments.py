"""Fragment plans: which parameter leaves are synced together, and when.

A plan is a pure function of the leaf names and shapes, so every learner and the syncer
derive the same plan independently. Leaves are addressed by '/'-joined names
("block_0/attn/q"); fragment p is due after inner step t when (t - offset_p) % H == 0,
with offset_p = (p * H) // P, which staggers the P fragments evenly over H steps.

Strategies (P fragments; embedding leaves, if any, form their own fragments, first):
  balanced  the embedding gets k fragments, k chosen so that they and the others' bins are
            about equally big (k = 1 while the embedding is no bigger than a bin); when
            k > 1 the embedding leaves are cut into row slices (see below) packed into the
            k fragments. The other leaves, largest first (ties by name), each go to the
            currently smallest of the remaining bins (ties: fewest leaves, then lowest
            index), so bin sizes differ by at most the largest leaf. The default: flattest
            bandwidth (gemma_2b at P = 24: 6 embedding fragments, peak/mean 1.03).
  layer     blocks are strided over the bins, as in Streaming DiLoCo: the r-th block goes
            to bin r % bins; leaves outside blocks ("final_norm") join the smallest bin.
  tensor    leaves are grouped by kind (the name without "block_<i>/", e.g. all "attn/q")
            and whole kinds are bin-packed like `balanced`.
With P == 1 everything, embeddings included, is one fragment and `embedding_fragments` is
empty: it names only fragments made purely of embedding leaves (merged by weighted mean).

Members. A fragment's members are leaf names, or row slices of a leaf named
"<leaf>[<start>:<stop>]" (rows start..stop-1 of its first axis): only embedding leaves are
ever cut, only into embedding fragments, and only when their merge rule is elementwise
(the weighted mean: merging each slice is merging the leaf, so the merge stays per leaf).
Everything that moves fragments (syncer, learner protocol, offers and replies) is keyed by
member names; `split`/`join` and `join_members` map between members and whole leaves, and
the learner's replica slices its leaves by `parse_member`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from typing import Any

from decoupled_diloco.diloco.fragment_members import (
    embedding_fragments,
    embedding_groups,
    join_members,
    member_size,
    parse_member,
)

STRATEGIES = ("balanced", "layer", "tensor")
_BLOCK_RE = re.compile(r"^block_(\d+)/")


def _num_elements(shape: Any) -> int:
    return math.prod(tuple(getattr(shape, "shape", shape)))


@dataclasses.dataclass(frozen=True)
class FragmentPlan:
    """P disjoint, non-empty fragments covering every leaf, with their sync schedule."""

    names: tuple[tuple[str, ...], ...]  # leaf names per fragment, each sorted
    sync_every: int  # H: inner steps between two syncs of the same fragment
    offsets: tuple[int, ...]  # offset_p = (p * H) // P, in inner steps
    strategy: str
    embedding_fragment: int  # the first fragment made only of embedding leaves, -1 if none
    # Every fragment made only of embedding leaves or their row slices (default: the one
    # `embedding_fragment` names, as plans before embedding slices had).
    embedding_fragments: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(tuple(group) for group in self.names))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        frags = tuple(int(p) for p in self.embedding_fragments)
        if not frags and self.embedding_fragment >= 0:
            frags = (self.embedding_fragment,)
        object.__setattr__(self, "embedding_fragments", frags)
        if not self.names or any(not group for group in self.names):
            raise ValueError("diloco.fragments: a fragment plan must not contain empty fragments")
        if any(list(group) != sorted(group) for group in self.names):
            raise ValueError("diloco.fragments: leaf names in each fragment must be sorted")
        all_names = [name for group in self.names for name in group]
        if len(set(all_names)) != len(all_names):
            raise ValueError("diloco.fragments: a leaf appears in more than one fragment")
        if self.sync_every < 1:
            raise ValueError(f"diloco.sync_every must be >= 1, got {self.sync_every}")
        if len(self.offsets) != len(self.names):
            raise ValueError("diloco.fragments: need one offset per fragment")
        if not -1 <= self.embedding_fragment < len(self.names):
            raise ValueError(f"embedding_fragment {self.embedding_fragment} out of range")
        if any(not 0 <= p < len(self.names) for p in self.embedding_fragments):
            raise ValueError(f"embedding_fragments {self.embedding_fragments} out of range")
        self._check_slices()

    def _check_slices(self) -> None:
        """Row slices of a leaf must not overlap (`split` checks that they cover it)."""
        rows: dict[str, list[tuple[int, int]]] = {}
        for group in self.names:
            for name in group:
                leaf, r = parse_member(name)
                rows.setdefault(leaf, []).append((-1, -1) if r is None else (r.start, r.stop))
        for leaf, spans in rows.items():
            spans.sort()
            whole = (-1, -1) in spans and len(spans) > 1
            overlap = any(b[0] < a[1] for a, b in zip(spans[:-1], spans[1:], strict=True))
            if whole or overlap or any(start >= stop for start, stop in spans if start >= 0):
                raise ValueError(f"diloco.fragments: the members of {leaf!r} overlap")

    @property
    def num_fragments(self) -> int:
        return len(self.names)

    @functools.cached_property
    def _fragment_index(self) -> dict[str, int]:
        return {name: p for p, group in enumerate(self.names) for name in group}

    def fragment_of(self, name: str) -> int:
        """Index of the fragment holding leaf `name`."""
        try:
            return self._fragment_index[name]
        except KeyError:
            raise ValueError(f"leaf {name!r} is in no fragment of this plan") from None

    def due(self, step: int) -> list[int]:
        """Fragments due after completing inner step `step` (steps count from 1)."""
        if step <= 0:
            return []
        return [p for p, off in enumerate(self.offsets) if (step - off) % self.sync_every == 0]

    def slot(self, p: int, step: int) -> int:
        """The schedule slot r of an offer of p made at step offset_p + r·H (or after it)."""
        return (step - self.offsets[p]) // self.sync_every

    def split(self, flat: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A flat dict with exactly the plan's leaves -> one sub-dict of members per fragment
        (a row slice is a view of its leaf)."""
        self._check_names(set(flat), "split")
        out = []
        for group in self.names:
            part = {}
            for name in group:
                leaf, rows = parse_member(name)
                part[name] = flat[leaf] if rows is None else flat[leaf][rows]
            out.append(part)
        for leaf, stop in self._sliced_rows.items():
            if len(flat[leaf]) != stop:
                raise ValueError(f"split: {leaf!r} has {len(flat[leaf])} rows, slices {stop}")
        return out

    def join(self, parts: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Inverse of `split`: per-fragment dicts -> one flat dict of leaves, keys sorted."""
        if len(parts) != self.num_fragments:
            raise ValueError(f"join needs {self.num_fragments} fragments, got {len(parts)}")
        for p, (part, group) in enumerate(zip(parts, self.names, strict=True)):
            if set(part) != set(group):
                raise ValueError(f"join: fragment {p} has leaves {sorted(part)}, want {group}")
        return join_members({k: v for part in parts for k, v in part.items()})

    def fragment_bytes(self, shapes: Mapping[str, Any], dtype_bytes: int = 4) -> list[int]:
        """Bytes per fragment for leaves of `shapes` stored with `dtype_bytes` per element."""
        self._check_names(set(shapes), "fragment_bytes")
        return [sum(member_size(n, shapes) for n in group) * dtype_bytes for group in self.names]

    @functools.cached_property
    def _sliced_rows(self) -> dict[str, int]:
        """Leaf -> rows its slices cover, for the leaves cut into row slices."""
        rows = {}
        for group in self.names:
            for name in group:
                leaf, r = parse_member(name)
                if r is not None:
                    rows[leaf] = max(rows.get(leaf, 0), r.stop)
        return rows

    def to_json(self) -> dict:
        return {
            "names": [list(group) for group in self.names],
            "sync_every": self.sync_every,
            "offsets": list(self.offsets),
            "strategy": self.strategy,
            "embedding_fragment": self.embedding_fragment,
            "embedding_fragments": list(self.embedding_fragments),
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> FragmentPlan:
        return FragmentPlan(
            names=tuple(tuple(group) for group in d["names"]),
            sync_every=int(d["sync_every"]),
            offsets=tuple(int(o) for o in d["offsets"]),
            strategy=str(d["strategy"]),
            embedding_fragment=int(d["embedding_fragment"]),
            embedding_fragments=tuple(int(p) for p in d.get("embedding_fragments", ())),
        )

    def _check_names(self, got: set[str], what: str) -> None:
        want = {parse_member(name)[0] for name in self._fragment_index}
        if got != want:
            missing, extra = sorted(want - got)[:5], sorted(got - want)[:5]
            raise ValueError(f"{what}: plan leaves missing {missing}, unexpected {extra}")


def _bin_pack(items: list[tuple[str, int]], num_bins: int) -> list[list[str]]:
    """Greedy largest-first packing of (key, size) items into the currently smallest bin.

    Ties go to the bin with fewer items, then the lowest index: the item count only matters
    for zero-sized items, which would otherwise pile into one bin and leave others empty.
    """
    bins: list[list[str]] = [[] for _ in range(num_bins)]
    sizes = [0] * num_bins
    for key, size in sorted(items, key=lambda item: (-item[1], item[0])):
        b = min(range(num_bins), key=lambda i: (sizes[i], len(bins[i]), i))
        bins[b].append(key)
        sizes[b] += size
    return bins


def _group_layers(sizes: dict[str, int], num_bins: int) -> list[list[str]]:
    """Strided block groups: the r-th block (by index) -> bin r % num_bins."""
    block_of = {n: int(m.group(1)) for n in sizes if (m := _BLOCK_RE.match(n))}
    rank = {b: r for r, b in enumerate(sorted(set(block_of.values())))}
    bins: list[list[str]] = [[] for _ in range(num_bins)]
    for name in sorted(block_of):
        bins[rank[block_of[name]] % num_bins].append(name)
    bin_sizes = [sum(sizes[n] for n in group) for group in bins]
    # Leaves outside blocks are few and small: the smallest group takes them.
    smallest = min(range(num_bins), key=lambda i: (bin_sizes[i], i))
    bins[smallest].extend(sorted(n for n in sizes if n not in block_of))
    return bins


def _tensor_kind(name: str) -> str:
    return _BLOCK_RE.sub("", name)


def _group_tensor_kinds(sizes: dict[str, int], num_bins: int) -> list[list[str]]:
    """Whole tensor kinds ("attn/q" of every block) bin-packed by their total size."""
    kind_size: dict[str, int] = {}
    for name, size in sizes.items():
        kind_size[_tensor_kind(name)] = kind_size.get(_tensor_kind(name), 0) + size
    kind_bins = _bin_pack(list(kind_size.items()), num_bins)
    bin_of_kind = {kind: b for b, kinds in enumerate(kind_bins) for kind in kinds}
    bins: list[list[str]] = [[] for _ in range(num_bins)]
    for name in sorted(sizes):
        bins[bin_of_kind[_tensor_kind(name)]].append(name)
    return bins


_GROUPERS = {
    "balanced": lambda sizes, n: _bin_pack(list(sizes.items()), n),
    "layer": _group_layers,
    "tensor": _group_tensor_kinds,
}


def make_fragment_plan(
    shapes: Mapping[str, Any],
    num_fragments: int,
    strategy: str = "balanced",
    sync_every: int = 1,
    embedding_prefix: str = "embedder/",
    split_embedding: bool = True,
) -> FragmentPlan:
    """Deterministic plan of `num_fragments` (P) fragments synced every `sync_every` (H) steps.

    `shapes` maps leaf names to shapes (tuples, or anything with a `.shape`). The result
    depends only on the names and sizes, never on dict insertion order. `split_embedding`:
    balanced plans may cut the embedding into row slices over several fragments (only valid
    when the embedding's merge rule is elementwise; see the module docstring).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"diloco.fragment_strategy={strategy!r}; expected one of {STRATEGIES}")
    if not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"diloco.fragments must be an int >= 1, got {num_fragments!r}")
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"diloco.sync_every must be an int >= 1, got {sync_every!r}")
    if not shapes:
        raise ValueError("diloco.fragments: the parameter tree has no leaves")
    if num_fragments > len(shapes):
        raise ValueError(
            f"diloco.fragments={num_fragments} exceeds the number of leaves ({len(shapes)})"
        )
    sizes = {name: _num_elements(shape) for name, shape in shapes.items()}
    embedding = sorted(n for n in sizes if n.startswith(embedding_prefix))
    k = 1
    if num_fragments == 1:
        groups, embedding_fragment = [sorted(sizes)], -1
    elif embedding:
        rest = {n: s for n, s in sizes.items() if not n.startswith(embedding_prefix)}
        if strategy == "balanced" and split_embedding:
            k = embedding_fragments(sizes, embedding, rest, num_fragments)
        groups = embedding_groups(shapes, embedding, k, _bin_pack) if k > 1 else [embedding]
        groups += _GROUPERS[strategy](rest, num_fragments - k) if rest else []
        embedding_fragment = 0
    else:
        groups, embedding_fragment = _GROUPERS[strategy](sizes, num_fragments), -1
    if len(groups) != num_fragments or any(not group for group in groups):
        raise ValueError(
            f"diloco.fragments={num_fragments} would leave an empty fragment with "
            f"diloco.fragment_strategy={strategy!r}; use fewer fragments"
        )
    return FragmentPlan(
        names=tuple(tuple(sorted(group)) for group in groups),
        sync_every=sync_every,
        offsets=tuple((p * sync_every) // num_fragments for p in range(num_fragments)),
        strategy=strategy,
        embedding_fragment=embedding_fragment,
        embedding_fragments=tuple(range(k)) if embedding_fragment == 0 else (),
    )


def model_plan(model_cfg, diloco_cfg) -> FragmentPlan:
    """The fragment plan of a model under a `DilocoConfig` (deterministic: every process
    derives the same one)."""

    from decoupled_diloco import models

    abstract = models.param_shapes(model_cfg)
    shapes = {k: tuple(v.shape) for k, v in models.flatten_params(abstract).items()}
    return make_fragment_plan(
        shapes, diloco_cfg.fragments, diloco_cfg.fragment_strategy, diloco_cfg.sync_every,
        split_embedding=diloco_cfg.embedding_merge == "mean",  # RDA norms are per leaf
    )  # fmt: skip
