"""decoupled_diloco/seeds.py: every seed config.validate accepts has a key of its own."""

import jax
import numpy as np

from decoupled_diloco import seeds


def _data(k) -> list[int]:
    return np.asarray(jax.random.key_data(k)).tolist()


def test_seeds_past_32_bits_get_keys_of_their_own_and_the_others_keep_theirs():
    """jax.random.key(2**32 + 5) is seed 5's key with 64-bit types off: two runs seeded
    apart by 2**32 trained the same model."""
    for small in (0, 5, 2**31 + 1, 2**32 - 1):
        assert _data(seeds.key(small)) == _data(jax.random.key(small))  # (results kept)
    keys = [seeds.key(s) for s in (0, 5, 2**32, 2**32 + 5, 2**40, 2**63 - 1)]
    assert len({tuple(_data(k)) for k in keys}) == len(keys)
    assert _data(seeds.key(np.int64(2**32 + 5))) == _data(seeds.key(2**32 + 5))
