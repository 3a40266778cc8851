"""Explicit device <-> host transfers: the only module that moves parameter bytes.

Learners hand fragments to the syncer as host numpy arrays and receive merged fragments
back as host arrays; everything else stays on device. Keeping the transfers here lets
tests run train steps under `jax.transfer_guard("disallow")` and makes the cost of
communication visible in one place.
"""

from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils


def start_to_host(arrays: Mapping[str, jax.Array]) -> None:
    """Starts asynchronous device->host copies so a later `to_host` does not stall."""
    for a in arrays.values():
        a.copy_to_host_async()


def _gather(a: jax.Array, readonly: bool = False) -> np.ndarray:
    if readonly and len(a.sharding.device_set) == 1:
        return np.asarray(a)  # the transfer's own buffer (read-only), no second copy
    if not a.is_fully_addressable:
        # A learner spanning several hosts: the slice all-gathers inside itself (the
        # learner's own collective, never across learners), then every host holds it.
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    out = np.empty(a.shape, dtype=a.dtype)
    for shard in a.addressable_shards:
        if shard.replica_id == 0:  # copy each distinct piece once
            out[shard.index] = np.asarray(shard.data)
    return out


def to_host(arrays: Mapping[str, jax.Array], readonly: bool = False) -> dict[str, np.ndarray]:
    """Copies named (possibly sharded) arrays to host memory, shard by shard, into arrays
    the caller owns. `readonly`: the caller only reads them, so an array on one device
    comes back as the transfer's own (read-only) buffer, without a second copy."""
    start_to_host(arrays)
    return {name: _gather(a, readonly) for name, a in arrays.items()}


def to_device(
    arrays: Mapping[str, np.ndarray], shardings: Mapping[str, jax.sharding.Sharding]
) -> dict[str, jax.Array]:
    """Places host arrays with the given shardings (works when devices span hosts): each of
    this host's devices gets its piece by an explicit `jax.device_put`, so placing passes
    `jax.transfer_guard("disallow")` (`jax.make_array_from_callback` counts as an implicit
    transfer there, and a learner under that guard failed at its first merge)."""
    out = {}
    for name, x in arrays.items():
        sharding = shardings[name]
        x = np.asarray(x)
        pieces = sharding.addressable_devices_indices_map(x.shape)
        devices = list(pieces)
        shards = jax.device_put([x[pieces[d]] for d in devices], devices)
        out[name] = jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
    return out


def batch_to_device(
    rows: np.ndarray, sharding: jax.sharding.NamedSharding, global_rows: int | None = None
) -> jax.Array:
    """A learner's global batch from this host's rows.

    Each host of a multi-host learner reads only its own rows (data/pipeline.py, one row
    block per host): `rows` is [B / hosts, ...] and the global array [B, ...] is assembled
    from every host's rows without any host holding the others'. With one process `rows`
    is the whole batch. `global_rows`: B, checked (ValueError: the hosts' rows would make
    another batch, e.g. each host read all of it).
    """
    hosts = len({d.process_index for d in sharding.mesh.devices.flat})
    global_shape = (rows.shape[0] * hosts, *rows.shape[1:])
    if global_rows is not None and global_shape[0] != global_rows:
        raise ValueError(
            f"{rows.shape[0]} rows on each of the learner's {hosts} hosts make a batch of "
            f"{global_shape[0]} rows, not train.batch_size={global_rows}: each host must "
            "read only its own rows (data.make_iterator's host_index and num_hosts)"
        )
    if hosts > 1:
        _check_rows_split_by_process(sharding, global_shape)
    return jax.make_array_from_process_local_data(sharding, np.asarray(rows), global_shape)


def _check_rows_split_by_process(sharding, global_shape) -> None:
    """Per-host reading needs every process to hold its own, equally many batch rows."""
    rows: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(global_shape).items():
        held = range(*index[0].indices(global_shape[0]))
        rows.setdefault(device.process_index, set()).update(held)
    check_rows_split_by_host(rows, global_shape[0])


def check_rows_split_by_host(rows: dict, batch_rows: int, where: str = "") -> None:
    """ValueError unless the hosts (`rows`: host -> the batch rows its devices hold) hold
    disjoint, equally many rows that make the whole batch: what per-host reading needs.
    `where`: how the hosts were found, for the message."""
    sizes = {len(r) for r in rows.values()}
    if sizes != {batch_rows // len(rows)} or len(set().union(*rows.values())) != batch_rows:
        raise ValueError(
            "the batch sharding does not split the batch rows evenly across the learner's "
            f"{len(rows)} hosts{where} (rows per host: {sorted(len(r) for r in rows.values())}"
            "): each host reads only its own rows, so the batch mesh axes (mesh.data, "
            "mesh.fsdp, mesh.expert) must run across hosts and mesh.tensor stay within one "
            "host's devices"
        )


def check_batch_split(sharding, batch_rows: int) -> None:
    """`_check_rows_split_by_process` before any batch is read (a learner's start-up)."""
    _check_rows_split_by_process(sharding, (batch_rows,))
