"""The Triton dequantize-matmul kernels for INT8 / FP8 / INT4 weights against the dequantize
reference.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton). Tiles are shrunk in some cases so several M/N/K tiles
and partial tiles occur.
On a GPU machine run the same tests on the device: INFERLAB_TRITON_DEVICE=cuda pytest ...
(bf16 is then added to the dtypes, and the layers' CUDA dispatch is checked too).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

DEVICE = os.environ.get("INFERLAB_TRITON_DEVICE", "cpu")  # see tests/conftest.py

from engines.builtin.layers import quant_triton  # noqa: E402
from engines.builtin.layers.fp8 import Fp8Method  # noqa: E402
from engines.builtin.layers.linear import Linear  # noqa: E402
from engines.builtin.layers.quant import Int4Method, Int8Method  # noqa: E402

assert DEVICE != "cpu" or quant_triton.interpreting(), "Triton interpreter not active"


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE != "cpu" else [])
# fp32: IEEE dots, exact up to summation order. 16-bit: x, the dequantized weight tile and the
# output are rounded to the dtype, so allow a fraction of the output's max |y|.
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
MS = [1, 5, 33]
SMALL = dict(block_n=16, block_k=32)  # several N and K tiles on small shapes


class PlainInt4(Int4Method):
    """Int4Method that always keeps the plain-nibble layout (the non-CPU layout)."""

    @staticmethod
    def packable(layer: Linear) -> bool:
        return False


def make_layer(method, out: int, inn: int, dtype: torch.dtype, seed: int = 0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, inn, generator=gen) * 0.05).to(dtype)
    layer = Linear(inn, out, method, bias=False)
    layer.name = "test.proj"
    layer.load(w, None)
    return layer.to(DEVICE)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)


def _assert_close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.shape == ref.shape and y.dtype == dtype
    err = (y.float() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err


# (out = N, in = K, tile overrides): multiples of 16, then ragged N and K (K=40: partial K tile)
INT8_SHAPES = [(32, 64, {}), (64, 128, SMALL), (40, 40, SMALL)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(("n", "k", "tiles"), INT8_SHAPES)
def test_int8_matmul_matches_dequantized_reference(
    n: int, k: int, tiles: dict, m: int, dtype: torch.dtype
) -> None:
    method = Int8Method()
    layer = make_layer(method, n, k, dtype)
    x = _x(m, k, dtype)
    y = quant_triton.int8_matmul(x, layer.qweight, layer.scales, **tiles)
    _assert_close(y, x.float() @ method.dequantize(layer).T, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(("n", "k", "tiles"), INT8_SHAPES)
def test_fp8_matmul_matches_torch_s_own_float8_conversion(
    n: int, k: int, tiles: dict, m: int, dtype: torch.dtype
) -> None:
    """Every e4m3 byte but NaN, subnormals and the extremes included, widened by the kernel's
    integer operations, against torch's float8_e4m3fn -> float32."""
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes[torch.randint(0, len(codes), (n, k), generator=gen)].view(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
    x = _x(m, k, dtype)
    y = quant_triton.fp8_matmul(x, q.to(DEVICE), scale.to(DEVICE), **tiles)
    _assert_close(y, x.float() @ (q.float() * scale[:, None]).to(DEVICE).T, dtype)


# (group, N, K, tile overrides): groups 32/64/128; N=40 ragged; K=96 with 64-wide K tiles
INT4_SHAPES = [
    (32, 32, 96, {}),
    (64, 48, 128, SMALL),
    (128, 40, 256, SMALL),
    (32, 40, 64, dict(block_n=32, block_k=16)),
]


@pytest.mark.parametrize("zero_point", ["float", "int"])  # the same kernel serves both
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(("group", "n", "k", "tiles"), INT4_SHAPES)
def test_int4_matmul_matches_dequantized_reference(
    group: int, n: int, k: int, tiles: dict, m: int, dtype: torch.dtype, zero_point: str
) -> None:
    method = PlainInt4(group, zero_point)
    layer = make_layer(method, n, k, dtype)
    assert not layer.int4_packed and layer.qweight.shape == (n, k // 2)
    x = _x(m, k, dtype)
    y = quant_triton.int4_matmul(x, layer.qweight, layer.scales_and_zeros, group, **tiles)
    _assert_close(y, x.float() @ method.dequantize(layer).T, dtype)


def test_strided_input_and_empty_batch() -> None:
    method = Int8Method()
    layer = make_layer(method, 32, 64, torch.float32)
    x = _x(5, 128, torch.float32)[:, ::2]  # non-unit K stride
    y = quant_triton.int8_matmul(x, layer.qweight, layer.scales)
    _assert_close(y, x.float() @ method.dequantize(layer).T, torch.float32)
    assert quant_triton.int8_matmul(x[:0], layer.qweight, layer.scales).shape == (0, 32)


def test_bad_inputs_are_refused() -> None:
    layer = make_layer(Int8Method(), 32, 64, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        quant_triton.int8_matmul(_x(2, 48, torch.float32), layer.qweight, layer.scales)
    with pytest.raises(ValueError, match="dtype"):
        quant_triton.int8_matmul(_x(2, 64, torch.float32).double(), layer.qweight, layer.scales)
    with pytest.raises(ValueError, match=r"fp8_matmul: q must be torch\.float8_e4m3fn"):
        quant_triton.fp8_matmul(_x(2, 64, torch.float32), layer.qweight, layer.scales)
    layer4 = make_layer(PlainInt4(32), 32, 64, torch.float32)
    with pytest.raises(ValueError, match="scales_and_zeros must be"):
        quant_triton.int4_matmul(
            _x(2, 64, torch.float32), layer4.qweight, layer4.scales_and_zeros[:1], 32
        )


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the layers only dispatch to Triton on CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "method", [Int8Method(), PlainInt4(64), PlainInt4(64, "int"), Fp8Method("on CUDA")]
)
def test_layers_dispatch_to_triton_on_cuda(method, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(128, 48, method, bias=True)
    layer.load(
        (torch.randn(48, 128, generator=gen) * 0.05).to(dtype).cuda(),
        torch.randn(48, generator=gen).to(dtype).cuda(),
    )
    x = _x(3 * 5, 128, dtype).reshape(3, 5, 128)
    y = layer(x)
    ref = x.float() @ method.dequantize(layer).T + layer.bias.float()
    assert y.shape == (3, 5, 48) and y.dtype == dtype
    assert (y.float() - ref).abs().max() <= TOL[dtype] * ref.abs().max()
