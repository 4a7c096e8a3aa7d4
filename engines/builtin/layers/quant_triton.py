"""Triton dequantize-matmul kernels for the weight-only INT8, FP8 and INT4 linear layers (CUDA
path).

Both compute y [M, N] = x [M, K] @ W.T with W the weight the stored form represents (the same
numbers as `Int8Method.dequantize` / `Int4Method.dequantize`), never materialising W: a program
owns one [BLOCK_M, BLOCK_N] output tile and walks K in BLOCK_K steps, loading the quantized
weight tile as [BLOCK_K, BLOCK_N] (transposed addressing of the [N, ...] storage), dequantizing
it in registers, and accumulating tl.dot in fp32. Ragged M, N and K are masked. tl.dot tiles are
>= 16 in every dimension. fp32 inputs use IEEE dot products (not TF32).

* `int8_matmul(x, q int8 [N, K], scale [N])`: W = q * scale[:, None]. The integer tile is
  converted to x's dtype (exact: |q| <= 127), and the per-row scale is applied once to the
  accumulated tile.
* `fp8_matmul(x, q float8_e4m3fn [N, K], scale [N])`: W = value * scale[:, None], the same
  kernel with each byte widened by integer operations into the float16 of its value / 256
  (exact, subnormals included), so any GPU runs it, not only those with FP8 instructions.
* `int4_matmul(x, qweight uint8 [N, K/2], scales_and_zeros [K/group, N, 2], group_size)`: the
  plain-nibble layout (even column in the low 4 bits, odd column in the high 4 bits) and
  W[n, k] = (q - 8) * scale[k // g, n] + zero[k // g, n], torch's int4 convention. Each element
  is dequantized in fp32 and then rounded to x's dtype for the dot.

On CPU the kernels only run under the Triton interpreter: TRITON_INTERPRET=1 must be in the
environment before triton is first imported (the tests do that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot needs >= 16 in every dimension
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when this module's kernels were built for the Triton interpreter (CPU)."""
    return type(_int8_matmul_kernel).__name__ == "InterpretedFunction"


# ---- kernels --------------------------------------------------------------------------------


@triton.jit
def _output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile of y: its row and column offsets and masks."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _load_input_tile(x_ptr, offs_m, ks, mask_m, mask_k, stride_xm, stride_xk):
    """x's [BLOCK_M, BLOCK_K] tile at columns `ks` (zeros outside x)."""
    return tl.load(
        x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )


@triton.jit
def _store_output_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_yn):
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _int8_matmul_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qk,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n = _output_tile(M, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = _load_input_tile(x_ptr, offs_m, ks, mask_m, mask_k, stride_xm, stride_xk)
        q = tl.load(
            q_ptr + offs_n[None, :] * stride_qn + ks[:, None] * stride_qk,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0,
        )  # [BLOCK_K, BLOCK_N]
        if FP8:
            # e4m3 byte SEEEEMMM -> float16 S0EEEEMMM0000000, the value / 256 (subnormals too):
            # integer ops any GPU (and the interpreter) runs; -16385 is 0xBFFF as an int16
            h = ((q.to(tl.int16) << 8) >> 1) & -16385
            w = h.to(tl.float16, bitcast=True).to(tl.float32).to(x.dtype)
        else:
            w = q.to(tl.float32).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    acc = acc * (scale[None, :] * 256.0 if FP8 else scale[None, :])
    _store_output_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_yn)


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    q_ptr,
    sz_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qk,
    stride_sg,
    stride_sn,
    stride_sc,
    stride_ym,
    stride_yn,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n = _output_tile(M, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = _load_input_tile(x_ptr, offs_m, ks, mask_m, mask_k, stride_xm, stride_xk)
        mask_w = mask_n[None, :] & mask_k[:, None]  # [BLOCK_K, BLOCK_N]
        byte = tl.load(
            q_ptr + offs_n[None, :] * stride_qn + (ks[:, None] // 2) * stride_qk,
            mask=mask_w,
            other=0,
        ).to(tl.int32)
        q = (byte >> ((ks[:, None] % 2) * 4)) & 0xF
        sz = sz_ptr + (ks[:, None] // GROUP_SIZE) * stride_sg + offs_n[None, :] * stride_sn
        scale = tl.load(sz, mask=mask_w, other=0.0).to(tl.float32)
        zero = tl.load(sz + stride_sc, mask=mask_w, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - 8.0) * scale + zero).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    _store_output_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_yn)


# ---- launchers ------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None


def _tile(n: int, cap: int) -> int:
    return max(MIN_DOT, min(cap, triton.next_power_of_2(n)))


def _check(x: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{what}: x dtype {x.dtype} not supported (float32|float16|bfloat16)")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"{what}: needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")


def _grid(m: int, n: int, block_m: int, block_n: int) -> tuple[int, int]:
    return (triton.cdiv(m, block_m), triton.cdiv(n, block_n))


def int8_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (q int8 [N, K] * scale [N, None]).T, in x's dtype."""
    return _per_row_matmul(x, q, scale, torch.int8, block_m, block_n, block_k)


def fp8_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (q float8_e4m3fn [N, K] * scale [N, None]).T, in x's dtype:
    FP8 weights widened in registers (weight-only, any GPU)."""
    return _per_row_matmul(x, q, scale, torch.float8_e4m3fn, block_m, block_n, block_k)


def _per_row_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
    block_m: int | None, block_n: int, block_k: int,
) -> torch.Tensor:  # fmt: skip
    n, k = q.shape
    name = "fp8_matmul" if dtype == torch.float8_e4m3fn else "int8_matmul"
    _check(x, k, name)
    if q.dtype != dtype or scale.shape != (n,):
        raise ValueError(
            f"{name}: q must be {dtype} [N, K] and scale [N]; got {q.dtype} "
            f"{tuple(q.shape)} and {tuple(scale.shape)}"
        )
    fp8 = dtype == torch.float8_e4m3fn
    if fp8:
        q = q.view(torch.uint8)
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bm = block_m or _tile(m, 64)
    _int8_matmul_kernel[_grid(m, n, bm, block_n)](
        x,
        q,
        scale,
        y,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        q.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype),
        FP8=fp8,
    )
    return y


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T for plain-nibble INT4 weights.

    qweight: uint8 [N, K/2] (column 2j in the low nibble of byte j, 2j+1 in the high one);
    scales_and_zeros: [K/group_size, N, 2], W[n, k] = (q - 8) * scale + zero of group k // g.
    """
    n, half_k = qweight.shape
    k = 2 * half_k
    _check(x, k, "int4_matmul")
    if qweight.dtype != torch.uint8 or k % group_size:
        raise ValueError(
            f"int4_matmul: qweight must be uint8 [N, K/2] with K % group_size == 0;"
            f" got {qweight.dtype} {tuple(qweight.shape)}, group {group_size}"
        )
    if scales_and_zeros.shape != (k // group_size, n, 2):
        raise ValueError(
            f"int4_matmul: scales_and_zeros must be [{k // group_size}, {n}, 2], "
            f"got {tuple(scales_and_zeros.shape)}"
        )
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bm = block_m or _tile(m, 64)
    sz = scales_and_zeros
    _int4_matmul_kernel[_grid(m, n, bm, block_n)](
        x,
        qweight,
        sz,
        y,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        sz.stride(0),
        sz.stride(1),
        sz.stride(2),
        y.stride(0),
        y.stride(1),
        GROUP_SIZE=group_size,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype),
    )
    return y
