"""decoupled_diloco: Decoupled DiLoCo (arXiv 2604.21428) in JAX."""

__version__ = "0.1.0"
