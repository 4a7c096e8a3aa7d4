"""A mixture-of-experts layer's experts as two grouped GEMMs in Triton (the GPU path of
engines/builtin/moe.py; vLLM's fused_moe is the model).

The step's (token, expert) pairs come grouped by expert (moe.py sorts them once). Each expert's
run of pairs is padded to a multiple of BLOCK_M (`align_to_blocks`): every block of rows then
belongs to one expert, named by `block_experts`, and one launch covers every expert: a program
owns a [BLOCK_M, BLOCK_N] tile of the output, gathers its pairs' input rows (padding rows read
nothing and are not stored), and walks K against its expert's weight tile, accumulating tl.dot
in fp32. The weights are the experts' stacked [E, N, K] (moe.py stacks them once).

`grouped_experts` runs an expert MLP this way: gate_up for every pair, SiLU-and-multiply, down,
and each pair's output weighted and added into its token's row, expert by expert in ascending
order as the module path adds them (index_add_ per expert).

On CPU the kernel only runs under the Triton interpreter: TRITON_INTERPRET=1 must be in the
environment before triton is first imported (the tests do that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engines.builtin.layers.quant_triton import DTYPES, MIN_DOT, interpreting


@triton.jit
def _grouped_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rows_ptr,
    experts_ptr,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)  # padded pair positions
    rows = tl.load(rows_ptr + slots)  # each slot's input row; -1 for padding
    expert = tl.load(experts_ptr + block)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rows >= 0, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the expert's weight rows offs_n, transposed
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    tl.store(
        y_ptr + slots[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def align_to_blocks(
    rows: torch.Tensor, counts: list[int], block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert (`rows`: each pair's input row, expert e's `counts[e]` after
    expert e - 1's) padded so that each expert's run fills whole blocks of `block_m`: the
    padded rows ([blocks x block_m], -1 for padding), each block's expert, and each pair's
    padded position."""
    padded = [-(-c // block_m) * block_m for c in counts]
    experts = torch.repeat_interleave(
        torch.arange(len(counts), dtype=torch.int32), torch.tensor(padded) // block_m
    )
    starts = torch.tensor([0, *padded[:-1]]).cumsum(0)
    position = torch.cat(
        [torch.arange(c) + int(s) for c, s in zip(counts, starts, strict=True)]
    ).to(torch.int64)
    slots = torch.full((sum(padded),), -1, dtype=torch.int64)
    slots[position] = rows.cpu().to(torch.int64)
    device = rows.device
    return slots.to(device), experts.to(device), position.to(device)


def grouped_matmul(
    x: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    block_experts: torch.Tensor,
    block_m: int,
    *,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """y [padded pairs, N]: row i = x[slots[i]] @ weights[expert of i's block].T (padding rows
    are left unwritten); x [T, K], weights [E, N, K], slots / block_experts from
    `align_to_blocks`."""
    experts, n, k = weights.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in DTYPES or weights.dtype != x.dtype:
        raise ValueError(
            f"grouped_matmul: x [T, {k}] and weights [E, N, {k}] of one dtype in "
            f"float32|float16|bfloat16; got {x.dtype} {tuple(x.shape)}, {weights.dtype}"
        )
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("grouped_matmul: needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if block_m < MIN_DOT or slots.numel() != block_experts.numel() * block_m:
        raise ValueError(f"grouped_matmul: {slots.numel()} slots in blocks of {block_m}")
    if (
        block_experts.numel()
        and not 0 <= int(block_experts.min()) <= int(block_experts.max()) < experts
    ):
        raise ValueError(f"grouped_matmul: a block names an expert outside [0, {experts})")
    y = torch.empty((slots.numel(), n), dtype=x.dtype, device=x.device)
    if slots.numel() == 0 or n == 0:
        return y
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        x, weights, y, slots, block_experts, n, k,
        x.stride(0), x.stride(1),
        weights.stride(0), weights.stride(1), weights.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
    )  # fmt: skip
    return y


def grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rows: torch.Tensor,
    counts: list[int],
    pair_weights: torch.Tensor,
    block_m: int = MIN_DOT,
) -> torch.Tensor:
    """sum over each token's pairs of weight x down(silu(gate) * up) of its row, [T, hidden];
    gate_up [E, 2I, hidden] and down [E, hidden, I] the experts' stacked weights, `rows`,
    `counts` and `pair_weights` the pairs grouped by expert as moe.py orders them."""
    slots, block_experts, position = align_to_blocks(rows, counts, block_m)
    inter = down.shape[2]
    h = grouped_matmul(x, gate_up, slots, block_experts, block_m)
    act = F.silu(h[:, :inter]) * h[:, inter:]  # padding rows: garbage, never read back
    # the second GEMM reads its own output rows: padded position i is input row i
    own = torch.where(slots >= 0, torch.arange(slots.numel(), device=slots.device), slots)
    y = grouped_matmul(act, down, own, block_experts, block_m)[position]
    out = torch.zeros_like(x)
    start = 0
    for count in counts:  # expert by expert: the module path's order of additions
        if count:
            span = slice(start, start + count)
            out.index_add_(0, rows[span], y[span] * pair_weights[span].unsqueeze(1))
            start += count
    return out
