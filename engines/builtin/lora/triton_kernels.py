"""Triton kernels for the LoRA delta on GPU, BGMV-style (Punica's batched gather matrix-vector
product, which vLLM's and SGLang's LoRA kernels grew from): every row gathers its own adapter's
weights by its slot index, so one launch serves a batch that mixes adapters and the base.

* `lora_shrink(x [T, in], a [S, P*R, in], slot_of_row [T], ranks [S])` -> h [T, P*R]: for
  part p, h[t, p*R + j] = x[t] . a[s, p*r + j] for j < r, where s is the row's slot and r its
  adapter's rank (a slot packs its parts at its own rank, engines/builtin/lora/layer.py);
  zeros elsewhere, and for rows of the base model (slot -1).
* `lora_expand(h, b [S, R, out], slot_of_row, ranks, y, part, column)`: y[t, column + n] +=
  sum_{j<r} h[t, part*R + j] * b[s, j, n] (B transposed, as the layer keeps it), in place, once
  per part of a fused layer.

A program owns one row and a block of outputs and walks the reduction in blocks, accumulating
in fp32. On CPU they run only under the Triton interpreter (TRITON_INTERPRET=1 before triton is
imported; the tests set it) and are checked there against the torch formulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, rank_ptr, h_ptr,
    K, R,
    stride_xt, stride_as, stride_ar, stride_ht,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row, part = tl.program_id(0), tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + row)
    # a base-model row (slot -1) has rank 0: every load masked, its h row zeros
    rank = tl.where(slot >= 0, tl.load(rank_ptr + tl.maximum(slot, 0)), 0)
    live = offs_r < rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_as + (part * rank + offs_r) * stride_ar
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        in_k = ks < K
        x = tl.load(x_ptr + row * stride_xt + ks, mask=in_k, other=0.0).to(tl.float32)
        a = tl.load(a_rows[:, None] + ks[None, :], mask=live[:, None] & in_k[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    out = h_ptr + row * stride_ht + part * R + offs_r
    tl.store(out, acc.to(h_ptr.dtype.element_ty), mask=offs_r < R)


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, slot_ptr, rank_ptr, y_ptr,
    N, R, part, column,
    stride_ht, stride_bs, stride_br, stride_yt,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        rank = tl.load(rank_ptr + slot)
        in_n = offs_n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(0, R, BLOCK_R):
            js = j + tl.arange(0, BLOCK_R)
            in_r = js < rank
            h = tl.load(h_ptr + row * stride_ht + part * R + js, mask=in_r, other=0.0)
            b = tl.load(
                b_ptr + slot * stride_bs + js[None, :] * stride_br + offs_n[:, None],
                mask=in_n[:, None] & in_r[None, :],
                other=0.0,
            )
            acc += tl.sum(b.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
        out = y_ptr + row * stride_yt + column + offs_n
        current = tl.load(out, mask=in_n, other=0.0)
        tl.store(out, (current.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=in_n)


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, slot_of_row: torch.Tensor, ranks: torch.Tensor, parts: int
) -> torch.Tensor:
    """h [T, parts * R] (R = a.shape[1] // parts), see the module's docstring."""
    rows, fan_in = x.shape
    max_rank = a.shape[1] // parts
    h = torch.zeros(rows, parts * max_rank, dtype=x.dtype, device=x.device)
    if rows == 0:
        return h
    x, a = x.contiguous(), a.contiguous()
    block_r = max(16, triton.next_power_of_2(min(max_rank, 64)))
    grid = (rows, parts, triton.cdiv(max_rank, block_r))
    _shrink_kernel[grid](
        x, a, slot_of_row, ranks, h,
        fan_in, max_rank,
        x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    return h


def lora_expand(
    h: torch.Tensor,
    b: torch.Tensor,
    slot_of_row: torch.Tensor,
    ranks: torch.Tensor,
    y: torch.Tensor,
    part: int,
    column: int,
) -> None:
    """y[:, column:column + b.shape[2]] += each row's part-`part` delta, in place."""
    rows, max_rank, outputs = h.shape[0], b.shape[1], b.shape[2]
    if rows == 0:
        return
    assert y.stride(1) == 1 and h.stride(1) == 1, "rows of y and h must be contiguous"
    assert b.stride(2) == 1, "b's output dimension must be contiguous"
    block_n = 64
    grid = (rows, triton.cdiv(outputs, block_n))
    _expand_kernel[grid](
        h, b, slot_of_row, ranks, y,
        outputs, max_rank, part, column,
        h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(min(max_rank, 64))),
    )  # fmt: skip
