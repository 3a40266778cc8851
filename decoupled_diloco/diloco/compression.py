"""Wire compression of fragments (offers and replies): none, bf16 and block-quantised ints.

Methods and their per-element error bounds (x a tensor flattened, blocks of `block_size`
consecutive elements, the last one possibly shorter):
  none  float32 as is; exact for float32 input.
  bf16  round-to-nearest-even to bfloat16: |err| <= 2^-8 |x| (half an ulp of 8 bits), for
        |x| below bf16's largest finite value (~3.39e38: larger ones round to inf).
  intN  N in {8, 4, 2}: symmetric absmax scaling per block, scale = absmax / (2^(N-1) - 1),
        q = round(x / scale) in [-(2^(N-1) - 1), 2^(N-1) - 1]: |err| <= scale / 2 (plus
        float32 rounding; a scale below float32's normal range is rounded to a multiple of
        2^-149, or to 0, which adds up to 2^(N-1) · 2^-150 ≈ 1e-43 for int8). int4 packs two
        values per byte, int2 four ({-1, 0, 1} · absmax).
  int1  the sign bit, 8 per byte, times the block's mean |x| (1-bit SGD style). Keeps
        each element's sign and each block's mean |x|, but no elementwise bound: lossy.
Scales travel as float32. Non-finite inputs poison their block (decode gives NaN there),
so a receiver's finiteness check still catches them. An `Encoded` holds only numpy arrays
with standard dtypes (bf16 as uint16 bits), tuples and strings: it pickles cheaply and
crosses process boundaries (e.g. Ray's object store) without custom serialisers.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

METHODS = ("none", "bf16", "int8", "int4", "int2", "int1")
_INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
_F32_EPS = float(np.finfo(np.float32).eps)


@dataclasses.dataclass
class Encoded:
    """A compressed dict of tensors: name -> (shape, payload, scales)."""

    method: str
    tensors: dict[str, tuple]  # (shape tuple, payload 1-D array, float32 scales per block)
    block_size: int = 256

    def nbytes(self) -> int:
        """Bytes on the wire: payloads plus scales (names and shapes are negligible)."""
        return sum(payload.nbytes + scales.nbytes for _, payload, scales in self.tensors.values())


def _check(method: str, block_size: int) -> None:
    if method not in METHODS:
        raise ValueError(f"diloco.compression={method!r}; expected one of {METHODS}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"compression block_size must be an int >= 1, got {block_size!r}")


def _blocks(flat: np.ndarray, block_size: int) -> np.ndarray:
    """[n] -> [ceil(n / block_size), block_size], zero-padded (zeros leave absmax alone)."""
    num_blocks = -(-flat.size // block_size)
    if flat.size == num_blocks * block_size:
        return flat.reshape(num_blocks, block_size)
    padded = np.zeros(num_blocks * block_size, flat.dtype)
    padded[: flat.size] = flat
    return padded.reshape(num_blocks, block_size)


def _scaled_by_block(values: np.ndarray, scales: np.ndarray, block_size: int) -> np.ndarray:
    """values[i] * scales[i // block_size] as a new float32 [n] array (never padded to a
    whole block: a block larger than the tensor costs nothing)."""
    out = values.astype(np.float32)
    whole = values.size // block_size
    if whole:
        out[: whole * block_size].reshape(whole, block_size)[...] *= scales[:whole, None]
    if whole * block_size < values.size:
        out[whole * block_size :] *= scales[whole]
    return out


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes < 2^bits -> bytes, 8 // bits codes per byte, first code in low bits."""
    per_byte = 8 // bits
    padded = np.zeros(-(-codes.size // per_byte) * per_byte, np.uint8)
    padded[: codes.size] = codes
    grouped = padded.reshape(-1, per_byte)
    packed = grouped[:, 0].copy()
    for j in range(1, per_byte):
        packed |= grouped[:, j] << np.uint8(bits * j)
    return packed


def _unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of `_pack`: the first n codes. (Per-column shifts: a broadcast shift is slow.)"""
    mask = np.uint8((1 << bits) - 1)
    columns = [(packed >> np.uint8(shift)) & mask for shift in range(0, 8, bits)]
    return np.stack(columns, axis=1).reshape(-1)[:n]


def _absmax_scales(flat: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    qmax = (1 << (bits - 1)) - 1
    return (np.max(np.abs(_blocks(flat, block_size)), axis=1) / np.float32(qmax)).astype(np.float32)


def _encode_int(flat: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    qmax = (1 << (bits - 1)) - 1
    scales = _absmax_scales(flat, bits, block_size)
    with np.errstate(divide="ignore", invalid="ignore"):
        # Divided, not multiplied by 1 / scale: a subnormal scale's inverse is inf.
        q = _blocks(flat, block_size) / np.where(scales > 0, scales, np.float32(1))[:, None]
        np.rint(q, out=q)
        np.clip(q, -qmax, qmax, out=q)
        q = q.reshape(-1)[: flat.size].astype(np.int8)  # NaN: any code; its scale is NaN
    if bits == 8:
        return q.view(np.uint8), scales
    return _pack((q + np.int8(qmax)).view(np.uint8), bits), scales


def _encode_sign(flat: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = _blocks(np.abs(flat), block_size)
    counts = np.full(blocks.shape[0], block_size, np.float32)
    if flat.size % block_size:
        counts[-1] = flat.size % block_size
    with np.errstate(over="ignore"):
        sums = blocks.sum(axis=1, dtype=np.float32)
    scales = sums / counts
    over = np.isinf(sums)  # finite values can sum past float32's range (256 of 1e37)
    if over.any():  # (rare: not every block pays for float64)
        scales[over] = blocks[over].sum(axis=1, dtype=np.float64) / counts[over]
    return np.packbits(flat >= 0, bitorder="little"), scales


def encode(
    arrays: dict[str, np.ndarray], method: str, block_size: int = 256, copy: bool = True
) -> Encoded:
    """Compresses float tensors with `method` (see module docstring); inputs are untouched.
    `copy=False`: the caller hands over float32 arrays it never writes again, which "none"
    then carries as they are (one pass over the bytes fewer)."""
    _check(method, block_size)
    tensors = {}
    no_scales = np.zeros(0, np.float32)
    for name, x in arrays.items():
        x = np.asarray(x)
        shape = tuple(int(d) for d in x.shape)
        flat = x.astype(np.float32, copy=False).reshape(-1)
        if method == "none":  # copy: the sender may update its arrays while this is in flight
            tensors[name] = (shape, flat.copy() if copy else flat, no_scales)
        elif method == "bf16":
            tensors[name] = (shape, flat.astype(ml_dtypes.bfloat16).view(np.uint16), no_scales)
        elif method == "int1":
            tensors[name] = (shape, *_encode_sign(flat, block_size))
        else:
            tensors[name] = (shape, *_encode_int(flat, _INT_BITS[method], block_size))
    return Encoded(method, tensors, block_size)


def decode(enc: Encoded) -> dict[str, np.ndarray]:
    """Float32 tensors of their original shapes.

    For "none" these are read-only views of the payload (zero copy; an `Encoded` may be
    shared by several receivers): copy before writing. Other methods return new arrays.
    """
    _check(enc.method, enc.block_size)
    out = {}
    for name, (shape, payload, scales) in enc.tensors.items():
        n = int(np.prod(shape, dtype=np.int64))
        _check_codes(name, enc.method, n, enc.block_size, payload, scales)
        if enc.method == "none":
            x = payload.view()
            x.flags.writeable = False
        elif enc.method == "bf16":
            x = payload.view(ml_dtypes.bfloat16).astype(np.float32)
        elif enc.method == "int1":
            signs = _unpack(payload, 1, n).astype(np.float32) * 2 - 1
            x = _scaled_by_block(signs, scales, enc.block_size)
        else:
            bits = _INT_BITS[enc.method]
            if bits == 8:
                q = payload.view(np.int8)
            else:
                codes, qmax = _unpack(payload, bits, n), (1 << (bits - 1)) - 1
                if n and codes.max() > 2 * qmax:  # (offset to [0, 2·qmax] by the encoder)
                    raise ValueError(f"{name}: {enc.method} code {codes.max()} above {2 * qmax}")
                q = codes.view(np.int8) - np.int8(qmax)
            x = _scaled_by_block(q, scales, enc.block_size)
        if x.size != n:
            raise ValueError(f"{name}: payload holds {x.size} values, shape {shape} needs {n}")
        out[name] = x.reshape(shape)
    return out


def _check_codes(name, method, n, block_size, payload, scales) -> None:
    """ValueError unless the payload holds exactly the bytes and codes `encode` makes for n
    values, and (intN, int1) one float32 scale per block: a decoder reading past the codes
    (cut off, broadcast, padded) or codes no encoder writes would merge what was not sent."""
    if method in ("none", "bf16"):
        return  # (their decoded size and dtype are the caller's checks)
    bits = _INT_BITS.get(method, 1)
    want = -(-n * bits // 8)
    if payload.dtype != np.uint8 or payload.ndim != 1 or payload.size != want:
        raise ValueError(f"{name}: {method} payload of {payload.dtype} {payload.shape}, "
                         f"{n} values need {want} uint8 bytes")  # fmt: skip
    blocks = -(-n // block_size)
    if scales.dtype != np.float32 or scales.shape != (blocks,):
        raise ValueError(f"{name}: scales of {scales.dtype} {scales.shape}, {n} values in "
                         f"blocks of {block_size} need {blocks} float32")  # fmt: skip
    if method == "int8" and n and payload.view(np.int8).min() < -127:
        raise ValueError(f"{name}: int8 code -128 (codes lie in [-127, 127])")


def max_abs_error_bound(x: np.ndarray, method: str, block_size: int = 256) -> float:
    """The stated bound on max |decode(encode(x)) − x| for one tensor x (float32 input).

    Includes float32 rounding slack for intN: a few ulps of the block absmax, and the
    subnormal scale's absolute rounding (module docstring); inf for int1, which has no
    elementwise bound.
    """
    _check(method, block_size)
    flat = np.asarray(x, np.float32).reshape(-1)
    if method == "none" or flat.size == 0:
        return 0.0
    if method == "int1":
        return float("inf")
    absmax = float(np.max(np.abs(flat)))
    if method == "bf16":
        return 2.0**-8 * absmax + 2.0**-134  # second term: half the bf16 subnormal spacing
    scales = _absmax_scales(flat, _INT_BITS[method], block_size)
    qmax = (1 << (_INT_BITS[method] - 1)) - 1
    # A scale under 2^-126 is rounded to a multiple of 2^-149 (to 0 below 2^-150): codes
    # that clip at qmax and the decoded product then err by up to (qmax + 1) · 2^-150.
    subnormal = (qmax + 1) * 2.0**-149  # (twice that: slack, as for normal scales)
    return float(np.max(scales / 2 + 8 * _F32_EPS * scales * qmax)) + subnormal
