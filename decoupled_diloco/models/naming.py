"""Leaf names: the one contract between a model's nested param tree and everything else.

Outside `models/` params are a flat dict keyed by stable '/'-joined names
("block_0/attn/q"); fragments, checkpoints, sharding rules and logs all share them.
"""

from collections.abc import Mapping
from typing import Any


def flatten_params(params: Mapping) -> dict[str, Any]:
    """Nested dict of arrays -> {"block_0/attn/q": array, ...}, keys sorted."""
    flat: dict[str, Any] = {}

    def visit(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                if not isinstance(key, str) or not key or "/" in key:
                    raise ValueError(f"param key {key!r} under {prefix!r}: need a str without '/'")
                visit(f"{prefix}/{key}" if prefix else key, child)
        else:
            flat[prefix] = node

    visit("", params)
    return dict(sorted(flat.items()))


def unflatten_params(flat: Mapping[str, Any]) -> dict:
    """Inverse of `flatten_params`: '/'-joined names back to a nested dict."""
    nested: dict = {}
    for name, leaf in sorted(flat.items()):
        *parents, last = name.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"leaf name {name!r} nests under another leaf")
        if last in node:
            raise ValueError(f"leaf name {name!r} collides with a subtree")
        node[last] = leaf
    return nested
