"""JAX's persistent compilation cache, shared by every process of the project.

Compiling a train step costs seconds to minutes; with the cache a restarted learner, a
resumed run, a Ray actor and the next test session load it instead. Location:
`$DD_COMPILATION_CACHE`, default `~/.cache/decoupled_diloco_jax`; a gs://... cache is shared
by every host of a TPU run (JAX reads it through etils.epath, hence gcsfs: the [tpu] extra).
"""

import os

DEFAULT_DIR = os.path.expanduser("~/.cache/decoupled_diloco_jax")


def enable() -> str:
    """Points JAX at the cache (any time before the first compilation); returns its path."""
    import jax

    path = os.environ.get("DD_COMPILATION_CACHE", DEFAULT_DIR)
    if "://" not in path:
        path = os.path.abspath(os.path.expanduser(path))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path
