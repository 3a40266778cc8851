"""Held-out evaluation counts every window of the eval split once (train/evaluate.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco import models, sharding
from decoupled_diloco.data import load_corpus
from decoupled_diloco.data.windows import PackedWindows
from decoupled_diloco.train.evaluate import Evaluator, first_reads
from decoupled_diloco.train.step import chunked_cross_entropy, cross_entropy, token_nll


def _small_eval_split(small_config, tmp_path, seq_len):
    text = "".join(f"line {i}: {'abcdefghij'[i % 10] * (i % 7 + 3)} of a small corpus\n"
                   for i in range(300))  # fmt: skip
    (tmp_path / "c.txt").write_text(text)
    return config_lib.validate(
        small_config(**{"data.path": str(tmp_path / "c.txt"), "data.seq_len": seq_len})
    )


@pytest.mark.slow  # (the default suite is kept under ~10 min on 2 cores)
def test_an_eval_split_smaller_than_a_batch_counts_each_window_once(small_config, tmp_path):
    """11 windows in a batch of 32 were scored as 10 of them three times and one twice:
    the loss was a weighted mean of the split. Rows that wrap around count 0 now."""
    run = _small_eval_split(small_config, tmp_path, seq_len=16)
    eval_tokens = load_corpus(run.data).splits["eval"]
    n = (len(eval_tokens) - 1) // 16
    assert 1 < n < 32 and 32 % n, n  # one batch, windows read unevenly often
    mesh = sharding.make_mesh(jax.devices()[:1])
    params = models.init_params(run.model, jax.random.key(3))
    evaluator = Evaluator(run.model, run.data, mesh, 32, 5)
    assert len(evaluator.batches) == 1 and evaluator.row_weights[0].sum() == n
    # Each window alone: the split's mean over its tokens.
    windows = PackedWindows(eval_tokens, 16, 0, 1, seed=0).take(n)
    alone = Evaluator(run.model, run.data, mesh, 1, 0, [w[None] for w in windows])
    assert len({tuple(w) for w in windows}) == n
    np.testing.assert_allclose(evaluator(params), alone(params), rtol=1e-6)


def test_a_split_of_several_batches_leaves_out_only_the_wrapped_rows(small_config, tmp_path):
    run = _small_eval_split(small_config, tmp_path, seq_len=8)
    eval_tokens = load_corpus(run.data).splits["eval"]
    n = (len(eval_tokens) - 1) // 8
    assert n > 8 and n % 8, n
    evaluator = Evaluator(run.model, run.data, sharding.make_mesh(jax.devices()[:2]), 8, 100)
    weights = np.concatenate(evaluator.row_weights)
    assert len(evaluator.batches) == -(-n // 8)
    assert weights[:n].all() and not weights[n:].any()
    rows = np.concatenate(evaluator.batches)
    assert len({tuple(r) for r in rows[:n]}) == n  # the first reads are the split's windows
    assert {tuple(r) for r in rows[n:]} <= {tuple(r) for r in rows[:n]}


def test_first_reads():
    batches = [np.zeros((4, 3))] * 3
    assert [w.tolist() for w in first_reads(batches, 9)] == [[1] * 4, [1] * 4, [1, 0, 0, 0]]
    assert [w.tolist() for w in first_reads(batches[:2], 100)] == [[1] * 4] * 2
    assert [w.tolist() for w in first_reads(batches[:1], None)] == [[1] * 4]


@pytest.mark.parametrize("chunk", [0, 4, 6])  # 6: a last chunk of 2 padded positions
def test_row_weights_weigh_each_rows_tokens(chunk):
    """Weights (2, 0, 1) give the mean of a batch holding row 0 twice and row 2 once."""
    cfg = models.get_model_config("tiny", logits_chunk=chunk)
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    x_BTD = jnp.asarray(rng.normal(size=(3, 8, cfg.d_model)), jnp.float32)
    targets_BT = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 8)), jnp.int32)
    embedding = params["embedder"]["embedding"]
    nll_BT = token_nll(models.output_logits(cfg, embedding, x_BTD), targets_BT)
    expected = float(jnp.concatenate([nll_BT[0], nll_BT[0], nll_BT[2]]).mean())
    w_B = jnp.asarray([2.0, 0.0, 1.0])
    if chunk:
        got = chunked_cross_entropy(cfg, embedding, x_BTD, targets_BT, w_B)
    else:
        got = cross_entropy(models.output_logits(cfg, embedding, x_BTD), targets_BT, w_B)
    np.testing.assert_allclose(float(got), expected, rtol=1e-6)


def test_row_weights_with_the_embedding_gathered_once():
    """The same weighted mean when each device sums its own rows' chunks
    (`model.logits_gather = "once"`: shard_map over a data 2 x fsdp 4 mesh), a padded last
    chunk included."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = models.get_model_config("tiny", logits_chunk=6, logits_gather="once")
    mesh = sharding.make_mesh(jax.devices()[:8], sharding.MeshConfig(data=2, fsdp=4))
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    x_BTD = jnp.asarray(rng.normal(size=(8, 8, cfg.d_model)), jnp.float32)
    targets_BT = jnp.asarray(rng.integers(0, cfg.vocab_size, (8, 8)), jnp.int32)
    w_B = jnp.asarray([2.0, 0.0, 1.0, 1.0, 0.0, 3.0, 1.0, 0.5])
    embedding = params["embedder"]["embedding"]
    expected = cross_entropy(models.output_logits(cfg, embedding, x_BTD), targets_BT, w_B)
    rows = P(("data", "fsdp"))
    placed = ((embedding, P(None, "fsdp")), (x_BTD, rows), (targets_BT, rows), (w_B, rows))
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in placed]

    def loss(*args):
        return chunked_cross_entropy(cfg, *args)

    with sharding.constraint_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(loss)(*args))
        got = jax.jit(loss)(*args)
    np.testing.assert_allclose(float(got), float(expected), rtol=1e-6)


def _fake_host(tmp_path, cgroup: str, files: dict) -> str:
    """A root folder with /proc/meminfo (8 GiB available), /proc/self/cgroup and `files`."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: 1 kB\nMemAvailable: {8 * 2**20} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path) + "/"


GiB = 2**30


@pytest.mark.parametrize(
    "cgroup, files, expected",
    [
        # v2, a container's own group at the mount's root: 2 GiB limit, 1.5 used, 0.25 cache
        ("0::/\n", {"sys/fs/cgroup/memory.max": f"{2 * GiB}\n",
                    "sys/fs/cgroup/memory.current": f"{3 * GiB // 2}\n",
                    "sys/fs/cgroup/memory.stat": f"anon 1\ninactive_file {GiB // 4}\n"},
         GiB * 3 // 4),
        # v2 seen from the host: the group's own folder; no limit: MemAvailable
        ("0::/job\n", {"sys/fs/cgroup/job/memory.max": "max\n",
                       "sys/fs/cgroup/job/memory.current": "5\n"}, 8 * GiB),
        # v1 (this machine's layout), the group's folder, 4 GiB limit, 1 used
        ("4:memory:/a/b\n1:cpu:/\n", {"sys/fs/cgroup/memory/a/b/memory.limit_in_bytes":
                                      f"{4 * GiB}\n",
                                      "sys/fs/cgroup/memory/a/b/memory.usage_in_bytes":
                                      f"{GiB}\n"}, 3 * GiB),
        # v1 inside a cgroup namespace: the mount's root is the group; unlimited
        ("4:memory:/a/b\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
                             "sys/fs/cgroup/memory/memory.usage_in_bytes": "1"}, 8 * GiB),
        # a limit above MemAvailable: MemAvailable
        ("0::/\n", {"sys/fs/cgroup/memory.max": f"{64 * GiB}\n",
                    "sys/fs/cgroup/memory.current": "0\n"}, 8 * GiB),
    ],
)  # fmt: skip
def test_available_host_memory_heeds_the_cgroup_limit(tmp_path, cgroup, files, expected):
    """In a container started with a memory limit MemAvailable is the host's: the OS killed
    an evaluation the check had let through."""
    from decoupled_diloco.host_memory import available_host_bytes

    assert available_host_bytes(_fake_host(tmp_path, cgroup, files)) == expected
