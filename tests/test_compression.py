"""Wire compression: round trips within the stated bounds, packing, sizes, edge cases."""

import pickle

import numpy as np
import pytest

from decoupled_diloco.diloco import compression
from decoupled_diloco.diloco.compression import METHODS, decode, encode, max_abs_error_bound

BOUNDED = ("none", "bf16", "int8", "int4", "int2")
BLOCK = 16


def inputs() -> dict[str, np.ndarray]:
    """Random and adversarial tensors: odd sizes (not multiples of the block or of 2/4/8)."""
    rng = np.random.default_rng(0)
    outlier = rng.standard_normal(101).astype(np.float32)
    outlier[37] = 1e6
    return {
        "normal": rng.standard_normal((7, 9)).astype(np.float32),
        "tiny": (1e-20 * rng.standard_normal(35)).astype(np.float32),
        "zeros": np.zeros((3, 5), np.float32),
        "outlier": outlier,
        "scalar": np.asarray(-2.5, np.float32),
        "single": np.asarray([3.0], np.float32),
        "empty": np.zeros((0, 4), np.float32),
        "constant": np.full(BLOCK + 3, -0.75, np.float32),
        # a block whose absmax is subnormal: 1 / scale overflowed, every value to ±absmax
        "subnormal": np.asarray([1e-39, 3e-40, -5e-40, 0.0, 2e-41], np.float32),
    }


@pytest.mark.parametrize("method", METHODS)
def test_round_trip_keeps_names_shapes_and_dtype(method):
    x = inputs()
    y = decode(encode(x, method, BLOCK))
    assert list(y) == list(x)
    for k in x:
        assert y[k].shape == x[k].shape and y[k].dtype == np.float32


@pytest.mark.parametrize("method", BOUNDED)
@pytest.mark.parametrize("block_size", [BLOCK, 5, 256])
def test_round_trip_within_stated_bound_per_block(method, block_size):
    for name, x in inputs().items():
        y = decode(encode({name: x}, method, block_size))[name]
        flat_x, flat_y = x.reshape(-1), y.reshape(-1)
        # Blocks are independent, so the bound must hold block by block, not just overall.
        for start in range(0, flat_x.size, block_size):
            xb, yb = flat_x[start : start + block_size], flat_y[start : start + block_size]
            bound = max_abs_error_bound(xb, method, block_size)
            assert np.max(np.abs(yb - xb)) <= bound, (name, start)


@pytest.mark.parametrize("method", ["int8", "int4", "int2"])
def test_bound_holds_where_the_block_scale_is_subnormal_or_zero(method):
    # absmax / qmax below 2^-150 rounds the scale to 0 (the block decodes to zeros), and a
    # subnormal scale is off by up to 2^-150 (codes clip at qmax): errors of ~qmax · 2^-150
    tiny, rng = np.float32(2.0**-149), np.random.default_rng(5)
    for units in [*range(1, 300), 1000, 4321, 2**20, 2**23]:
        x = (rng.integers(-units, units + 1, 64) * tiny).astype(np.float32)
        x[7] = units * tiny
        err = np.max(np.abs(decode(encode({"x": x}, method, 64))["x"] - x))
        assert err <= max_abs_error_bound(x, method, 64), units


def test_none_is_exact_and_decoded_views_are_read_only():
    x = inputs()
    enc = encode(x, "none")
    x["normal"][0, 0] = 123.0  # the payload is a copy: later writes by the sender don't leak
    y = decode(enc)
    assert y["normal"][0, 0] != 123.0
    assert all(np.array_equal(y[k], v) for k, v in inputs().items())
    with pytest.raises(ValueError):
        y["normal"][0, 0] = 1.0


def test_bf16_is_round_to_nearest_even_with_relative_bound():
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0], np.float32)
    y = decode(encode({"x": x}, "bf16"))["x"]
    # Ties go to the even mantissa: 1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6.
    np.testing.assert_array_equal(y, [1.0, 1.0 + 2**-6, -1.0, 3.0])
    r = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 1e3
    r_hat = decode(encode({"r": r}, "bf16"))["r"]
    assert np.all(np.abs(r_hat - r) <= 2.0**-8 * np.abs(r))


@pytest.mark.parametrize("method,levels", [("int8", 127), ("int4", 7), ("int2", 1)])
def test_int_codes_are_symmetric_multiples_of_the_block_scale(method, levels):
    x = np.random.default_rng(2).standard_normal(4 * BLOCK + 3).astype(np.float32)
    y = decode(encode({"x": x}, method, BLOCK))["x"]
    for start in range(0, x.size, BLOCK):
        xb, yb = x[start : start + BLOCK], y[start : start + BLOCK]
        scale = np.max(np.abs(xb)) / levels
        codes = yb / scale
        np.testing.assert_allclose(codes, np.round(codes), atol=1e-3)
        assert np.max(np.abs(codes)) == pytest.approx(levels, abs=1e-3)  # absmax is exact


def test_int1_keeps_signs_and_block_mean_abs():
    x = np.random.default_rng(3).standard_normal(3 * BLOCK + 5).astype(np.float32)
    y = decode(encode({"x": x}, "int1", BLOCK))["x"]
    assert np.all(np.sign(y) == np.sign(x))
    for start in range(0, x.size, BLOCK):
        xb, yb = x[start : start + BLOCK], y[start : start + BLOCK]
        np.testing.assert_allclose(np.abs(yb), np.mean(np.abs(xb)), rtol=1e-6)
    assert max_abs_error_bound(x, "int1") == float("inf")
    zeros = decode(encode({"z": np.zeros(9, np.float32)}, "int1", 4))["z"]
    np.testing.assert_array_equal(zeros, 0.0)


def test_int1_of_huge_finite_values_is_finite():
    # 256 values of 1e37 sum past float32's range (~3.4e38); their mean |x| does not.
    rng = np.random.default_rng(4)
    blocks = [
        np.full(256, 1e37),
        3e38 * np.where(np.arange(256) % 2, 1, -1),
        rng.standard_normal(256),
        np.r_[np.ones(255), np.inf],  # still poisons its block
        np.full(5, -3e38),  # a short last block
    ]
    x = np.concatenate(blocks).astype(np.float32)
    y = decode(encode({"x": x}, "int1", 256))["x"]
    finite = np.ones(x.size, bool)
    finite[3 * 256 : 4 * 256] = False
    assert np.all(np.isfinite(y[finite])) and not np.any(np.isfinite(y[~finite]))
    assert np.all(np.sign(y[finite]) == np.sign(x[finite]))
    for start in (0, 256, 512, 1024):
        xb, yb = x[start : start + 256], y[start : start + 256]
        np.testing.assert_allclose(np.abs(yb), np.mean(np.abs(xb), dtype=np.float64), rtol=1e-6)


def test_nbytes_ratios():
    x = {"w": np.random.default_rng(4).standard_normal((64, 1024)).astype(np.float32)}
    fp32 = x["w"].nbytes
    assert encode(x, "none").nbytes() == fp32
    assert encode(x, "bf16").nbytes() == fp32 // 2
    scales = 4 * x["w"].size // 256
    for method, bits in [("int8", 8), ("int4", 4), ("int2", 2), ("int1", 1)]:
        assert encode(x, method).nbytes() == fp32 * bits // 32 + scales
    # Odd sizes round the packed payload up to whole bytes, never more.
    odd = {"w": np.ones(11, np.float32)}
    assert encode(odd, "int4", 4).nbytes() == 6 + 3 * 4
    assert encode(odd, "int2", 4).nbytes() == 3 + 3 * 4
    assert encode(odd, "int1", 4).nbytes() == 2 + 3 * 4


def test_non_finite_values_poison_their_block():
    x = np.ones(3 * BLOCK, np.float32)
    x[BLOCK + 2] = np.nan
    for method in ("int8", "int4", "int2", "int1", "bf16"):
        y = decode(encode({"x": x}, method, BLOCK))["x"]
        assert not np.all(np.isfinite(y[BLOCK : 2 * BLOCK])), method
        assert np.all(np.isfinite(y[:BLOCK])) and np.all(np.isfinite(y[2 * BLOCK :])), method


@pytest.mark.parametrize("method", METHODS)
def test_encoded_is_plain_numpy_and_picklable(method):
    enc = encode(inputs(), method, BLOCK)
    for shape, payload, scales in enc.tensors.values():
        assert isinstance(shape, tuple) and all(isinstance(d, int) for d in shape)
        for a in (payload, scales):
            assert type(a) is np.ndarray and a.dtype.kind in "fiu"
    again = pickle.loads(pickle.dumps(enc))
    y, z = decode(enc), decode(again)
    assert all(np.array_equal(y[k], z[k]) for k in y)


def test_errors():
    with pytest.raises(ValueError, match="diloco.compression"):
        encode({"x": np.ones(3, np.float32)}, "fp8")
    with pytest.raises(ValueError, match="diloco.compression"):
        decode(compression.Encoded("zip", {}))
    with pytest.raises(ValueError, match="diloco.compression"):
        max_abs_error_bound(np.ones(3), "int3")
    with pytest.raises(ValueError, match="block_size"):
        encode({"x": np.ones(3, np.float32)}, "int8", block_size=0)
    enc = encode({"x": np.ones(10, np.float32)}, "int8", 4)
    shape, payload, scales = enc.tensors["x"]
    enc.tensors["x"] = ((12,), payload, scales)  # corrupt: shape disagrees with the payload
    with pytest.raises(ValueError):
        decode(enc)


def _tampered(method: str, change) -> compression.Encoded:
    enc = encode({"x": np.linspace(-1, 1, 37, dtype=np.float32)}, method, 8)
    shape, payload, scales = enc.tensors["x"]
    enc.tensors["x"] = change(shape, payload.copy(), scales.copy())
    return enc


@pytest.mark.parametrize(
    "method, change, why",
    [
        # bytes past the codes (they were cut off unread), or a byte short
        ("int4", lambda s, p, c: (s, np.concatenate([p, np.zeros(1000, np.uint8)]), c), "need"),
        ("int1", lambda s, p, c: (s, np.concatenate([p, np.zeros(8, np.uint8)]), c), "need"),
        ("int8", lambda s, p, c: (s, p[:-1], c), "need"),
        # one scale for every block (it was broadcast), scales of another dtype
        ("int8", lambda s, p, c: (s, p, c[:1]), "scales of"),
        ("int2", lambda s, p, c: (s, p, c.astype(np.float64)), "scales of float64"),
        # codes no encoder writes: int8 -128, int4 15 (+8 scales), int2 3 (+2 absmax)
        ("int8", lambda s, p, c: (s, np.full_like(p, 128), c), "int8 code -128"),
        ("int4", lambda s, p, c: (s, np.full_like(p, 0xFF), c), "int4 code 15 above 14"),
        ("int2", lambda s, p, c: (s, np.full_like(p, 0xFF), c), "int2 code 3 above 2"),
    ],
)
def test_payloads_no_encoder_makes_are_refused(method, change, why):
    """Each of these decoded to values and merged (a review's fuzzing, 2026-11-30)."""
    with pytest.raises(ValueError, match=why):
        decode(_tampered(method, change))


def test_a_huge_block_costs_no_memory():
    """block_size is the sender's: a block far larger than the tensor padded every leaf to
    it (2**26 values: 256 MB per leaf for a 100-byte payload)."""
    import resource

    enc = encode({"x": np.ones(10, np.float32)}, "int8", block_size=16)  # one block
    enc.block_size = 2**40  # still one block
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    np.testing.assert_array_equal(decode(enc)["x"], np.ones(10, np.float32))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB
