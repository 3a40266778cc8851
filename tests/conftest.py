"""Test session set-up: 8 fake CPU devices and a persistent compilation cache.

Both must be configured before JAX initialises its backend, so this file sets them at
import time, before any test module imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


from decoupled_diloco import compile_cache  # noqa: E402

compile_cache.enable()

import threading  # noqa: E402

import pytest  # noqa: E402


def threads_left(before: set) -> list[str]:
    """Names of the threads started since `before` (a set of threading.enumerate()) that
    are still running: what a closed link, stager or run left behind."""
    return sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())


def _small_config(**overrides):
    """A tiny, fast run config; overrides use dotted keys: {"diloco.learners": 2}."""
    from decoupled_diloco.config import default_config

    c = default_config()
    c.model.preset = "tiny"
    c.data.seq_len = 64
    c.data.max_corpus_bytes = 400_000
    c.train.batch_size = 8
    c.train.steps = 12
    c.train.warmup_steps = 2
    c.train.eval_every = 0
    c.train.eval_batches = 2
    c.train.log_every = 1
    c.train.checkpoint_every = 0
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


@pytest.fixture
def small_config():
    return _small_config


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ray: starts a local Ray cluster (tests/test_ray_runtime.py); -m 'not ray' skips"
    )
    config.addinivalue_line(
        "markers",
        "slow: whole runs of 5 s or more on 2 cores, and the experiments' smoke "
        "tests (minutes); -m 'not slow' skips",
    )


def pytest_collection_modifyitems(config, items):
    """The default run skips `slow` and `ray` tests (kept under ~10 minutes on 2 cores);
    select them explicitly, e.g. `pytest tests -m "slow or ray"` (as .ci/run does)."""
    if config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason='slow/ray: run with -m "slow or ray"')
    for item in items:
        if "slow" in item.keywords or "ray" in item.keywords:
            item.add_marker(skip)
