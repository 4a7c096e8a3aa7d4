"""GGUF's quantized types decoded into levels, scales and minima (models/gguf_blocks.py) against
the `gguf` package's own dequantization: every kept type, bit for bit; and the QuantizedWeight
operations the loader applies (rows, columns, fusing, padding) against the same operations on
the dequantized weight."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from models.gguf_blocks import KEPT_TYPES, decode_blocks
from models.quantized_weight import QuantizedWeight

#: the types gguf-py quantizes itself; the K-quants it only dequantizes
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
#: where each K-quant block keeps its float16 d (and dmin)
K_SCALES = {
    "Q2_K": (80, 84),
    "Q3_K": (108, 110),
    "Q4_K": (0, 4),
    "Q5_K": (0, 4),
    "Q6_K": (208, 210),
}


def raw_tensor(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A tensor of `kind`'s bytes: quantized by gguf-py where it can, else random blocks with
    finite float16 scales (every other byte pattern is a valid block)."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in QUANTIZABLE:
        values = rng.standard_normal(shape).astype(np.float32) * 0.05
        values[0, :32] = 0.0  # an all-zero block: scale 0
        return gguf.quants.quantize(values, qtype)
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = shape[0] * shape[1] // block_weights
    raw = rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    start, stop = K_SCALES[kind]
    halves = (rng.random((blocks, (stop - start) // 2)) * 0.01).astype(np.float16)
    raw[:, start:stop] = halves.view(np.uint8)
    return raw.reshape(shape[0], -1)


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_every_kept_type_dequantizes_to_gguf_s_own_floats(kind: str) -> None:
    rng = np.random.default_rng(len(kind) + ord(kind[1]))
    shape = (3, 512)
    raw = raw_tensor(kind, shape, rng)
    weight = decode_blocks(kind, raw, shape)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(shape)
    assert np.array_equal(weight.dequantize().numpy(), np.asarray(expected, np.float32))
    assert weight.source == kind and weight.shape == shape
    assert int(weight.q.max()) < 2**weight.bits
    assert weight.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)


def test_bytes_that_do_not_fill_the_shape_are_refused_by_name() -> None:
    raw = raw_tensor("Q8_0", (2, 64), np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"Q8_0: 136 bytes do not hold \[2, 96\]"):
        decode_blocks("Q8_0", raw, (2, 96))
    with pytest.raises(ValueError, match="blocks of 256 weights"):
        decode_blocks("Q4_K", np.zeros(144, np.uint8), (1, 128))


def q(kind: str, shape: tuple[int, int], seed: int) -> QuantizedWeight:
    return decode_blocks(kind, raw_tensor(kind, shape, np.random.default_rng(seed)), shape)


def test_rows_columns_padding_and_fusing_match_the_float_weight() -> None:
    a, b, c = q("Q4_K", (4, 256), 1), q("Q6_K", (2, 256), 2), q("Q8_0", (3, 256), 3)
    fused = QuantizedWeight.cat([a, b, c])  # 4-bit g32, 8-bit g16, 8-bit g32: 8-bit g16
    assert (fused.bits, fused.group_size, fused.source) == (8, 16, "Q4_K+Q6_K+Q8_0")
    dense = torch.cat([a.dequantize(), b.dequantize(), c.dequantize()])
    assert torch.equal(fused.dequantize(), dense)
    order = torch.tensor([3, 0, 8, 1])
    assert torch.equal(fused[order].dequantize(), dense[order])
    assert torch.equal(fused.columns(slice(32, 96)).dequantize(), dense[:, 32:96])
    with pytest.raises(ValueError, match="split its groups of 16"):
        fused.columns(slice(8, 64))
    padded = a.padded_rows(6)
    assert torch.equal(padded.dequantize(), torch.cat([a.dequantize(), torch.zeros(2, 256)]))
    assert a.to(dtype=torch.bfloat16).dequantize().dtype == torch.bfloat16


def test_a_weight_whose_parts_do_not_fit_is_refused() -> None:
    a = q("Q8_0", (2, 64), 0)
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedWeight(a.q, a.scales[:, :1], a.mins, 32, 8, "Q8_0")


def test_symmetric_groups_become_int8_blocks_and_others_do_not() -> None:
    from engines.builtin.layers.checkpoint_quant import symmetric_blocks

    for kind in ("Q8_0", "Q5_0"):  # min = -128 d, -16 d; d float16
        weight = q(kind, (3, 256), 4)
        blocks = symmetric_blocks(weight)
        assert blocks is not None
        levels, d = blocks
        assert d.dtype == torch.float16 and levels.dtype == torch.int8
        rebuilt = (levels.float().reshape(3, 8, 32) * d.float()[..., None]).reshape(3, 256)
        assert torch.equal(rebuilt, weight.dequantize())
    for kind in ("Q5_1", "Q4_K", "Q6_K"):  # a float minimum, K-quant scales, groups of 16
        assert symmetric_blocks(q(kind, (3, 256), 5).with_group_size(16)) is None
    assert symmetric_blocks(q("Q5_1", (3, 256), 5)) is None
