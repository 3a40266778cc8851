"""PRNG keys from the framework's seeds (ints in [0, 2**63), config.validate)."""

import jax


def key(seed: int) -> jax.Array:
    """The key of `seed`. `jax.random.key` keeps only a seed's low 32 bits when 64-bit
    types are off (JAX's default): 2**32 + 5 gave seed 5's model. A seed below 2**32 keeps
    its key (runs keep their results); a larger one's high bits are folded into it."""
    seed = int(seed)
    low, high = seed & 0xFFFFFFFF, seed >> 32
    k = jax.random.key(low)
    return jax.random.fold_in(k, high) if high else k
