"""The order in which a shard visits its items (windows or records), epoch after epoch.

Item i of n belongs to shard i % num_shards, so shards are disjoint and together cover every
item. Within a shard, epoch e visits the items in a pseudo-random permutation keyed by
(seed, e, shard). The permutation is computed pointwise (a Feistel network with cycle
walking), never materialised: O(1) memory for billions of records, and a position in an
epoch is the whole iterator state.
"""

import dataclasses

import numpy as np

_FEISTEL_ROUNDS = 4  # Luby-Rackoff: 4 rounds of a pseudo-random function give a strong PRP
_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (multiplications wrap mod 2**64 on purpose)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _round_keys(*words: int) -> np.ndarray:
    """One uint64 key per Feistel round, hashed from the words (e.g. seed, epoch, shard)."""
    key = np.zeros(1, np.uint64)
    with np.errstate(over="ignore"):
        for w in words:
            key = _mix64(key ^ np.uint64(w & _MASK64)) + np.uint64(0x9E3779B97F4A7C15)
        return _mix64(key + np.arange(_FEISTEL_ROUNDS, dtype=np.uint64))


def permute(index_N: np.ndarray, n: int, key: tuple[int, ...]) -> np.ndarray:
    """Image of indices [N] (each in [0, n)) under the bijection of [0, n) named by `key`."""
    index_N = np.asarray(index_N, dtype=np.int64)
    if n <= 1:
        return index_N.copy()
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    keys = _round_keys(*key)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << shift) | right

    # The network permutes [0, 4**half_bits) ⊇ [0, n); cycle walking (re-applying it until the
    # value lands in range) restricts it to a permutation of [0, n). Domain < 4n: few walks.
    x = feistel(index_N.astype(np.uint64))
    out = x >= n
    while out.any():
        x[out] = feistel(x[out])
        out = x >= n
    return x.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class ShardedOrder:
    """Shard `shard_index` of `num_shards` over `num_items` items, reshuffled every epoch."""

    num_items: int
    shard_index: int
    num_shards: int
    seed: int

    def __post_init__(self):
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"shard_index={self.shard_index} must lie in [0, num_shards={self.num_shards})"
            )
        if self.size < 1:
            raise ValueError(
                f"num_shards={self.num_shards}: shard {self.shard_index} gets none of the "
                f"{self.num_items} items; use fewer shards or a bigger corpus"
            )

    @property
    def size(self) -> int:
        """Items in this shard (per epoch)."""
        return len(range(self.shard_index, self.num_items, self.num_shards))

    def items(self, epoch: int, positions_N: np.ndarray) -> np.ndarray:
        """Global item ids [N] at the given positions of `epoch`."""
        local_N = permute(positions_N, self.size, (self.seed, epoch, self.shard_index))
        return self.shard_index + self.num_shards * local_N

    def take(self, epoch: int, position: int, count: int) -> tuple[np.ndarray, int, int]:
        """The next `count` item ids from (epoch, position), crossing epochs as needed, and
        the (epoch, position) that follows them."""
        chunks = []
        while count > 0:
            n = min(count, self.size - position)
            chunks.append(self.items(epoch, np.arange(position, position + n)))
            count -= n
            position += n
            if position == self.size:
                epoch, position = epoch + 1, 0
        ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        return ids, epoch, position

    def next(self, epoch: int, position: int) -> tuple[int, int]:
        """The (epoch, position) after this one."""
        position += 1
        return (epoch + 1, 0) if position == self.size else (epoch, position)
