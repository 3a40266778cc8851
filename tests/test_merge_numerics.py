"""Syncer math at float32's edges: norms of narrow or long inputs, RDA of directions that
cancel to rounding."""

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


def opposite(x: np.ndarray, ulps: int) -> np.ndarray:
    """−x a few float32 ulps longer: the same direction reversed, to float32 rounding."""
    return (-x * np.float32(1 + ulps * 2.0**-23)).astype(np.float32)


@pytest.mark.parametrize("n", [4096, 300_001])  # one chunk; several, and a ragged row
@pytest.mark.parametrize("ulps", [1, 3])
def test_rda_of_directions_cancelling_to_rounding_is_zero(n, ulps):
    rng = np.random.default_rng(n + ulps)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    three = [x, y, -(x.astype(np.float64) + y).astype(np.float32)]
    d3 = np.sqrt([chunks.sq_norm(v) for v in three])  # Σ d_m φ(v_m) = Σ v_m / Σ‖v‖ = 0
    for vs, d in (([x, opposite(x, ulps)], [1.0, 1.0]), (three, d3)):
        offers = [{"w": v} for v in vs]
        delta = merge.merge_rda(offers, np.ones(len(vs)), direction=d)["w"]
        np.testing.assert_array_equal(delta, 0)  # not a full offer's length of rounding noise
        theta = {"w": np.ones(n, np.float32)}
        stepped, _ = merge.merge_outer_step(
            theta, offers, np.ones(len(vs)), "rda", merge.OuterState.zeros(theta), 1.0, 0.9,
            direction=d,
        )  # fmt: skip
        np.testing.assert_array_equal(stepped["w"], 1)


def test_rda_of_nearly_cancelling_directions_still_steps_where_they_are_resolvable():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(100_000)
    y = rng.standard_normal(100_000)
    y -= (x @ y) / (x @ x) * x  # ⊥ x, as long as x
    y *= np.linalg.norm(x) / np.linalg.norm(y)
    # ‖u‖ ≈ 2e-5, 10x above where two offers' rounding could reach
    vs = [x.astype(np.float32), (-x + 4e-5 * y).astype(np.float32)]
    got = merge.merge_rda([{"w": v} for v in vs], [1.0, 1.0])["w"].astype(np.float64)
    v64 = [v.astype(np.float64) for v in vs]
    u = sum(v / np.linalg.norm(v) for v in v64)
    want = np.mean([np.linalg.norm(v) for v in v64]) * u / np.linalg.norm(u)
    assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(want), rel=1e-5)
    assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) > 0.999
    # Rounding is judged against the nonzero offers' share of the direction weights: a
    # lone nonzero offer with a tiny share beside zero ones keeps its direction.
    zero = np.zeros_like(vs[0])
    got = merge.merge_rda([{"w": vs[0]}, {"w": zero}], [1.0, 1.0], direction=[1e-7, 1.0])
    np.testing.assert_allclose(got["w"], vs[0] / 2, rtol=1e-6)
