"""Syncer math at float32's edges: norms of narrow or long inputs."""

import ml_dtypes
import numpy as np
import pytest

from decoupled_diloco.diloco import chunks, merge


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_narrow_float_offers_are_normed_and_merged_as_their_float32_values(monkeypatch, dtype):
    monkeypatch.setattr(chunks, "CHUNK", 5000)  # chunks of a row (4096) and a rest
    rng = np.random.default_rng(0)
    # ‖x‖² ~ 4e8 per chunk: a float16 dot overflows (65504), a bfloat16 one keeps 8 bits
    xs = [(300 * rng.standard_normal(12_345)).astype(dtype) for _ in range(3)]
    as32 = [x.astype(np.float32) for x in xs]
    assert chunks.sq_norm(xs[0]) == chunks.sq_norm(as32[0])
    assert chunks.sq_norm(xs[0]) == pytest.approx(np.sum(as32[0].astype(np.float64) ** 2))
    w = [1.0, 2.0, 3.0]
    for rule in merge.RULES:
        got = merge.merge([{"w": x} for x in xs], w, rule)["w"]
        np.testing.assert_array_equal(got, merge.merge([{"w": x} for x in as32], w, rule)["w"])


def test_sq_norm_of_a_long_positive_sum_is_good_to_1e_8():
    x = np.random.default_rng(1).uniform(1, 2, 1 << 20).astype(np.float32)
    want = float(np.dot(x.astype(np.float64), x.astype(np.float64)))
    assert chunks.sq_norm(x) == pytest.approx(want, rel=2e-8)  # one dot a chunk: ~2e-7
    assert chunks.sq_norm(x, threads=3) == chunks.sq_norm(x)
