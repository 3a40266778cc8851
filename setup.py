"""Installs decoupled_diloco: `pip install -e .` (add `[test]` for the test tools)."""

import setuptools

setuptools.setup(
    name="decoupled_diloco",
    version="0.1.0",
    description=(
        "Resilient, asynchronous, low-communication LLM pre-training in JAX "
        "(Decoupled DiLoCo, arXiv 2604.21428)."
    ),
    packages=setuptools.find_packages(include=["decoupled_diloco", "decoupled_diloco.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The JAX the suite runs on (0.10.2, as the TPU launcher pins: scripts/tpu/tpu_cluster.py)
        # and newer: the train step uses shard_map's manual axes as jax 0.10 has them (pcast,
        # varying axes); flax 0.12 needs jax 0.10 too.
        "jax>=0.10",
        "jaxlib>=0.10",
        "flax>=0.12",
        "optax>=0.2.3",
        "orbax-checkpoint>=0.10",
        "ml-collections>=0.1.1",
        "tensorflow-datasets>=4.9.7",
        "absl-py>=2.0",
        "numpy>=1.26",
        "matplotlib>=3.8",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "ruff>=0.6",
            "ray[default]>=2.30",
            "tensorboard>=2.16",  # only to read back the event files the run writes
            # the [tpu] extra: the gs:// stand-in tests run the TPU path's tokenizer and
            # filesystem code as a TPU host has it
            "gcsfs>=2024.2",
            "sentencepiece>=0.2",
        ],
        "ray": ["ray[default]>=2.30"],
        # An NVIDIA GPU host: JAX with its CUDA 12 plugin and libraries from pip (the plain
        # install's jaxlib runs on the CPU only).
        "gpu": ["jax[cuda12]>=0.10"],
        # data.tokenizer = "sentencepiece" (trained locally on the corpus; TPU configs use it)
        "spm": ["sentencepiece>=0.2"],
        # A Cloud TPU host or head VM (scripts/tpu/): gs:// paths without TensorFlow (gcsfs,
        # for etils.epath / orbax / TFDS) and the TPU configs' tokenizer. jax[tpu] and Ray are
        # installed by the launcher, pinned to one version on every host.
        "tpu": ["gcsfs>=2024.2", "sentencepiece>=0.2"],
    },
)
