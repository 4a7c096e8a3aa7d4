"""GGUF's quantized weight types decoded into levels, scales and minima (`QuantizedWeight`,
W = q * scale + min per group) with no rounding: every scale and minimum is a float16 number
times a small integer (at most 8 bits), which float32 holds exactly, so each weight dequantizes
to the very float32 value `gguf.quants.dequantize` gives (tests/models/test_gguf_blocks.py).

Per type, the levels q (stored as), the group, and scale / min (d, dmin float16; sc, m the
block's integer sub-scales; llama.cpp's ggml-quants.c defines the layouts):

| type | bits | group | q | scale | min |
|---|---|---|---|---|---|
| Q4_0 | 4 | 32 | 0..15 | d | -8 d |
| Q4_1 | 4 | 32 | 0..15 | d | m (float16) |
| Q4_K | 4 | 32 | 0..15 | d sc | -dmin m |
| Q5_0 | 8 | 32 | 0..31 | d | -16 d |
| Q5_1 | 8 | 32 | 0..31 | d | m (float16) |
| Q5_K | 8 | 32 | 0..31 | d sc | -dmin m |
| Q6_K | 8 | 16 | 0..63 | d sc (sc signed) | -32 d sc |
| Q8_0 | 8 | 32 | int8 + 128 | d | -128 d |
| Q3_K | 8 | 16 | 0..7 | d (sc - 32) | -4 d (sc - 32) |
| Q2_K | 8 | 16 | 0..3 | d sc | -dmin m |

4-bit levels keep llama.cpp's 4-bit kernels' bytes (the engine's INT4 layout, groups of 32);
5- to 8-bit ones take a byte each (the engine's grouped INT8 layout): more bytes than the file
for Q5 (8 vs 5.5 bits a weight) and Q6_K (8 vs 6.56), the price of one kernel for all of them.
"""

from __future__ import annotations

import numpy as np
import torch

from models.quantized_weight import QuantizedWeight

QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, blocks: int, width: int) -> np.ndarray:
    """Bytes [blocks, ..., width] -> their low nibbles, then their high ones:
    [blocks, ..., 2, width]."""
    shifted = qs.reshape(blocks, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(
        1, 1, 2, 1
    )
    return shifted & np.uint8(15)


def _high_bits(qh: np.ndarray, blocks: int, count: int) -> np.ndarray:
    """Q5_0/Q5_1's 32-bit masks -> bit i of each block as [blocks, 32] (0 or 1)."""
    words = qh.copy().view(np.uint32).reshape(blocks, 1)
    return ((words >> np.arange(count, dtype=np.uint32).reshape(1, count)) & 1).astype(np.uint8)


def _k_scale_min(scales: np.ndarray, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-scales and sub-minima -> two [blocks, 8]."""
    s = scales.reshape(blocks, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], n, 16).reshape(n, 32)
    return q, d, -8 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    q = _nibbles(b[:, 4:], n, 16).reshape(n, 32)
    return q, _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:], n, 16).reshape(n, 32) | (_high_bits(b[:, 2:6], n, 32) << 4)
    return q, d, -16 * d


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    q = _nibbles(b[:, 8:], n, 16).reshape(n, 32) | (_high_bits(b[:, 4:8], n, 32) << 4)
    return q, _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, ...]:
    d = _f16(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = _k_scale_min(b[:, 4:16], n)
    q = _nibbles(b[:, 16:], n, 32).reshape(n, QK_K)  # 64-weight chunks: low then high nibbles
    return q, d * sc, -(dmin * m)


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = _k_scale_min(b[:, 4:16], n)
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:], n, 32).reshape(n, 8, 32) | ((qh & 1) << 4)
    return q.reshape(n, QK_K), d * sc, -(dmin * m)


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = _nibbles(ql, n, 64).reshape(n, 8, 32)
    high = (
        qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    ) & 3
    q = (low | (high.reshape(n, 8, 32) << 4)).reshape(n, QK_K)
    scale = d * sc
    return q, scale, -32 * scale


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    high = scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    sc = (low.reshape(n, 16) & 15) | ((high.reshape(n, 16) & 3) << 4)
    scale = d * (sc.astype(np.float32) - 32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    hm = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    # the level is ql - 4 where the mask bit is 0: q = ql + 4 * bit in 0..7, and min -4 scale
    q = ql.reshape(n, 8, 32) + (hm << 2)
    return q.reshape(n, QK_K), scale, -4 * scale


def _q2_k(b: np.ndarray) -> tuple[np.ndarray, ...]:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    return q.reshape(n, QK_K), d * (scales & 15), -(dmin * (scales >> 4))


#: type name -> (bytes a block, weights a block, group, bits, decoder)
_TYPES = {
    "Q4_0": (18, 32, 32, 4, _q4_0),
    "Q4_1": (20, 32, 32, 4, _q4_1),
    "Q5_0": (22, 32, 32, 8, _q5_0),
    "Q5_1": (24, 32, 32, 8, _q5_1),
    "Q8_0": (34, 32, 32, 8, _q8_0),
    "Q2_K": (84, QK_K, 16, 8, _q2_k),
    "Q3_K": (110, QK_K, 16, 8, _q3_k),
    "Q4_K": (144, QK_K, 32, 4, _q4_k),
    "Q5_K": (176, QK_K, 32, 8, _q5_k),
    "Q6_K": (210, QK_K, 16, 8, _q6_k),
}
KEPT_TYPES = tuple(_TYPES)


def decode_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor of `type_name` (KEPT_TYPES), `raw` its bytes, as the [out, in] `shape`
    QuantizedWeight it stores. ValueError for bytes that do not fill the shape's blocks."""
    block_bytes, block_weights, group, bits, decode = _TYPES[type_name]
    out, k = shape
    blocks = out * k // block_weights
    if k % block_weights or raw.size != blocks * block_bytes:
        raise ValueError(
            f"{type_name}: {raw.size} bytes do not hold [{out}, {k}] in blocks of "
            f"{block_weights} weights ({block_bytes} bytes each)"
        )
    q, scale, minimum = decode(
        np.ascontiguousarray(raw, dtype=np.uint8).reshape(blocks, block_bytes)
    )
    groups = k // group
    return QuantizedWeight(
        q=torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(out, k)),
        scales=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(out, groups)),
        mins=torch.from_numpy(np.ascontiguousarray(minimum, dtype=np.float32).reshape(out, groups)),
        group_size=group,
        bits=bits,
        source=type_name,
    )
