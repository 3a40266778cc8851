"""Checksums of array trees, written with every checkpoint and verified when it is restored.

A leaf's checksum is a position-weighted sum of its bit pattern, modulo 2**32:

    sum_i  word_i * (2i + 1)   (mod 2**32)

over its elements in C order, each element's bits zero-extended to a 32-bit word (8-byte
elements count as two words). Every weight is odd, hence invertible modulo 2**32, so any
change of a single word changes the sum, and a random multi-word corruption goes unnoticed
with probability ~2**-32 per leaf. It is not a cryptographic hash (nobody forges our
checkpoints); it is what a device can compute in one fused pass without gathering the array
onto one host: device arrays (learner TrainStates, sharded over a mesh) are summed by a jitted
reduction, host arrays (the syncer's state) by numpy in chunks. The two agree bit for bit
on the dtypes both have (tests/test_checkpoint_integrity.py), but a checkpoint is always
verified the way it was written (device states on devices, host states on the host).

Floating-point leaves must also be finite: nothing we checkpoint may legitimately hold NaN
or inf (learners do not save a diverged state; Θ only ever merges finite offers).
"""

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KEY = "_integrity"  # where a checkpoint's side-car JSON keeps what this module wrote
# numpy elements per pass: the temporaries stay ~1.5 MiB, so checksumming a syncer
# checkpoint's fragment copy adds next to nothing to it (a pass of 2**22 was also slower).
_CHUNK = 1 << 16


def _host_words(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    size = x.dtype.itemsize
    if size == 8:
        return x.view(np.uint32)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint32)


def _host_digest(x: np.ndarray) -> tuple[int, bool]:
    """(checksum, all finite), one chunk at a time (no temporary the size of `x`)."""
    x = np.ascontiguousarray(x).reshape(-1)
    floating = np.issubdtype(x.dtype, np.floating)
    total, finite = 0, True
    for start in range(0, x.size, _CHUNK):
        chunk = x[start : start + _CHUNK]
        w = _host_words(chunk)
        offset = (start * (2 if x.dtype.itemsize == 8 else 1)) % 2**32
        idx = np.arange(offset, offset + w.size, dtype=np.uint64).astype(np.uint32)
        weights = idx * np.uint32(2) + np.uint32(1)  # wraps modulo 2**32
        total = (total + int(np.sum(w * weights, dtype=np.uint32))) % 2**32
        finite = finite and (not floating or bool(np.isfinite(chunk).all()))
    return total, finite


def _device_words(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    narrow = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """The C-order flat index of every element, without reshaping (sharding-friendly)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride)
        stride *= shape[d]
    return index


@jax.jit
def _device_sums(leaves: list) -> tuple[list, jax.Array]:
    sums, finite = [], jnp.bool_(True)
    for x in leaves:
        weights = _flat_index(x.shape) * jnp.uint32(2) + jnp.uint32(1)
        sums.append(jnp.sum(_device_words(x) * weights, dtype=jnp.uint32))
        if jnp.issubdtype(x.dtype, jnp.floating):
            finite = finite & jnp.all(jnp.isfinite(x))
    return sums, finite


def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):  # GetAttrKey, DictKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    """(path, leaf) with paths that do not depend on the container types ("opt_state/1/mu"
    for a NamedTuple's field as for the dict orbax restores it as without a target)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(_key_name(k) for k in path), leaf) for path, leaf in flat]


def digest(tree: Any) -> tuple[dict[str, str], list[str]]:
    """({leaf path: checksum as 8 hex digits}, [paths of floating leaves with NaN/inf])."""
    named = _leaves(tree)
    on_device = [(n, x) for n, x in named if isinstance(x, jax.Array)]
    on_host = [(n, x) for n, x in named if not isinstance(x, jax.Array)]
    sums, bad = {}, []
    if on_device:
        device_sums, finite = _device_sums([x for _, x in on_device])
        sums.update({n: int(s) for (n, _), s in zip(on_device, device_sums, strict=True)})
        if not bool(finite):  # rare: name the leaves (one more pass)
            bad += [n for n, x in on_device if not _finite(x)]
    for n, x in on_host:
        sums[n], finite = _host_digest(np.asarray(x))
        if not finite:
            bad.append(n)
    return {n: f"{s:08x}" for n, s in sums.items()}, bad


def _finite(x) -> bool:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return True
    if isinstance(x, jax.Array):
        return bool(jnp.all(jnp.isfinite(x)))
    return bool(np.isfinite(x).all())


def _meta_hash(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def seal(arrays: Any, meta: dict) -> dict:
    """`meta` with the checksums of `arrays` and of itself; raises if `arrays` is not finite
    (a checkpoint of a broken state would only be refused when it is needed)."""
    sums, bad = digest(arrays)
    if bad:
        raise ValueError(f"refusing to checkpoint non-finite values in {', '.join(bad[:5])}")
    return {**meta, KEY: {"leaves": sums, "meta": _meta_hash(meta)}}


def check_meta(meta: Any) -> str:
    """Why the side-car JSON cannot be trusted ("" if it can). Checkpoints written before
    checksums existed carry none and pass (their arrays are still checked for finiteness)."""
    if not isinstance(meta, dict):
        return f"is not a JSON object but {type(meta).__name__}"
    sealed = meta.get(KEY)
    if sealed is None:
        return ""
    if not isinstance(sealed, dict):
        return f"has a malformed {KEY!r} entry ({type(sealed).__name__})"
    if _meta_hash(meta) != sealed.get("meta"):
        return "its metadata does not match its checksum"
    return ""


def check(arrays: Any, meta: dict, partial: bool = False) -> str:
    """Why a restored checkpoint cannot be trusted ("" if it can). `partial`: `arrays` is a
    dict holding some of the top-level entries that were sealed (only those are checked)."""
    reason = check_meta(meta)
    if reason:
        return reason
    sums, bad = digest(arrays)
    if bad:
        return f"non-finite values in {', '.join(bad[:5])}"
    expected = meta.get(KEY, {}).get("leaves")
    if expected is None:
        return ""
    if partial:
        expected = {n: s for n, s in expected.items() if n.split("/")[0] in arrays}
    if set(expected) != set(sums):
        return "its arrays are not the ones it was written with"
    wrong = [n for n in sums if sums[n] != expected[n]]
    if wrong:
        return f"checksum mismatch in {', '.join(wrong[:5])}"
    return ""
