"""Test session set-up: 8 fake CPU devices and a persistent compilation cache.

Both must be configured before JAX initialises its backend, so this file sets them at
import time, before any test module imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("DD_COMPILATION_CACHE", os.path.expanduser("~/.cache/decoupled_diloco_jax")),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
