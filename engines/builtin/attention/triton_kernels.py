"""Triton kernels for the paged KV cache: cache write, split-K decode, and paged prefill.

Cache layout (`LayerKVCache`): k_cache/v_cache are [num_blocks, block_size, kv_heads, head_dim]
(any strides). Every kernel addresses a key position `pos` of sequence `s` through its block
table: block = block_tables[s, pos // BLOCK_SIZE], row = pos % BLOCK_SIZE. Keys are gathered one
position at a time into a [BLOCK_N, head_dim] tile, so a tile never has to line up with a cache
block: any block size works (1 for a token-granular cache, 16 for the paged cache,
max_model_len for the contiguous one), and the tl.dot tiles stay >= 16 in every dimension.

* `write_kv`: grid (tokens, kv_heads); stores one token's K and V head; slots < 0 are padding.
* `decode_attention`: flash-decoding. Grid (sequences, kv_heads, partitions): one program
  handles all query heads of one KV head (the GQA group, padded to >= 16 rows for tl.dot) over
  one partition of PARTITION_SIZE context positions, in BLOCK_N-key tiles with an online
  softmax, and writes a partial (max, sum, unnormalised acc). A second kernel, grid
  (sequences, heads), rescales and sums the partials. When the longest context fits one
  partition, the first kernel normalises and writes the output itself (no second launch).
* `prefill_attention`: grid (query tiles, sequences, heads). A program takes BLOCK_M query rows
  of one sequence and head at positions seq_len - n + i, and walks BLOCK_N-key tiles from the
  first key visible to its first row (0, or the sliding window's start) to the last key visible
  to its last row, with a causal/window mask and online softmax. Keys come from the cache only,
  so the same kernel serves whole prompts, prefill chunks and prefix-cache hits.

INT8 KV (`kv_cache_dtype=int8`): the cache holds int8 values plus float16 scale planes
[num_blocks, block_size, kv_heads] (one per token and head, symmetric: scale = max|x| / 127).
`write_kv` quantizes in the kernel with the same arithmetic as `storage.quantize_int8`
(correctly rounded divisions, round half to even), so both write paths store the same bits.
The attention kernels load int8 tiles and their scales, dequantize in fp32 and round to q's
dtype (the numbers `storage.dequantize_int8` gives the dense path), then attend as usual.

Softmax runs in base 2 (scores are pre-multiplied by scale * log2(e)); accumulation is fp32.
fp32 inputs use IEEE dot products (not TF32), so fp32 results match the torch reference.
On CPU the kernels only run under the Triton interpreter: TRITON_INTERPRET=1 must be in the
environment before this module is imported (the tests do that).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)

DEFAULT_PARTITION_SIZE = 512
DEFAULT_DECODE_BLOCK_N = 64
DEFAULT_PREFILL_BLOCK_M = 64
DEFAULT_PREFILL_BLOCK_N = 64
MIN_DOT = 16  # tl.dot needs >= 16 in every dimension


def interpreting() -> bool:
    """True when this module's kernels were built for the Triton interpreter (CPU)."""
    return type(_write_kv_kernel).__name__ == "InterpretedFunction"


# ---- kernels --------------------------------------------------------------------------------


@triton.jit
def _round_half_even(x):
    """torch.round's rounding (half to even), exact for |x| < 2**22."""
    floor = tl.floor(x)
    frac = x - floor
    odd = floor - 2.0 * tl.floor(floor * 0.5)  # 1.0 where floor is odd
    return tl.where(frac > 0.5, floor + 1.0, tl.where(frac < 0.5, floor, floor + odd))


@triton.jit
def _quantize_int8(x):
    """One head of one token -> (int8 values, fp32 scale), as storage.quantize_int8: symmetric,
    scale = max|x| / 127 (correctly rounded divisions, so the bits match torch's)."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-8), 127.0)
    q = _round_half_even(tl.math.div_rn(x, scale))
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8), scale


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d * stride_kd, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d * stride_vd, mask=mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kcb + row * stride_kcs + h * stride_kch
    v_dst = v_cache_ptr + block * stride_vcb + row * stride_vcs + h * stride_vch
    if QUANTIZED:
        k_q, k_scale = _quantize_int8(k)
        v_q, v_scale = _quantize_int8(v)
        tl.store(k_dst + offs_d * stride_kcd, k_q, mask=mask)
        tl.store(v_dst + offs_d * stride_vcd, v_q, mask=mask)
        tl.store(
            k_scale_ptr + block * stride_ksb + row * stride_kss + h * stride_ksh,
            k_scale.to(k_scale_ptr.dtype.element_ty),
        )
        tl.store(
            v_scale_ptr + block * stride_vsb + row * stride_vss + h * stride_vsh,
            v_scale.to(v_scale_ptr.dtype.element_ty),
        )
    else:
        tl.store(k_dst + offs_d * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + offs_d * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_k_tile(
    k_cache_ptr,
    k_scale_ptr,
    block,
    row,
    kv_head,
    offs_d,
    n_mask,
    d_mask,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_ksb,
    stride_kss,
    stride_ksh,
    COMPUTE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Keys of one tile, transposed: [BLOCK_D, BLOCK_N] in the compute dtype. INT8 keys are
    dequantized in fp32 (value x its token's scale), then rounded to the compute dtype, the
    same numbers storage.dequantize_int8 gives the dense path."""
    k_off = block * stride_kcb + row * stride_kcs + kv_head * stride_kch
    k_t = tl.load(
        k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_kcd,
        mask=n_mask[None, :] & d_mask[:, None],
        other=0.0,
    )
    if QUANTIZED:
        scale = tl.load(
            k_scale_ptr + block * stride_ksb + row * stride_kss + kv_head * stride_ksh,
            mask=n_mask,
            other=0.0,
        )
        k_t = k_t.to(tl.float32) * scale.to(tl.float32)[None, :]
    return k_t.to(COMPUTE)


@triton.jit
def _load_v_tile(
    v_cache_ptr,
    v_scale_ptr,
    block,
    row,
    kv_head,
    offs_d,
    n_mask,
    d_mask,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_vsb,
    stride_vss,
    stride_vsh,
    COMPUTE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Values of one tile: [BLOCK_N, BLOCK_D] in the compute dtype (INT8 as for keys)."""
    v_off = block * stride_vcb + row * stride_vcs + kv_head * stride_vch
    v = tl.load(
        v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vcd,
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if QUANTIZED:
        scale = tl.load(
            v_scale_ptr + block * stride_vsb + row * stride_vss + kv_head * stride_vsh,
            mask=n_mask,
            other=0.0,
        )
        v = v.to(tl.float32) * scale.to(tl.float32)[:, None]
    return v.to(COMPUTE)


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    qk_scale,
    window,
    num_parts,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SINGLE_PART: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = g * GROUP + offs_h  # the query heads that share KV head g

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    compute = q_ptr.dtype.element_ty if QUANTIZED else k_cache_ptr.dtype.element_ty
    q = q.to(compute)

    lo = p * PARTITION_SIZE
    hi = tl.minimum(lo + PARTITION_SIZE, seq_len)
    if HAS_WINDOW:  # the query sits at seq_len - 1 and sees the last `window` keys
        lo = tl.maximum(lo, seq_len - window)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        k_t = _load_k_tile(
            k_cache_ptr,
            k_scale_ptr,
            block,
            row,
            g,
            offs_d,
            n_mask,
            d_mask,
            stride_kcb,
            stride_kcs,
            stride_kch,
            stride_kcd,
            stride_ksb,
            stride_kss,
            stride_ksh,
            compute,
            QUANTIZED,
        )
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one visible key (pos = start < hi), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        v = _load_v_tile(
            v_cache_ptr,
            v_scale_ptr,
            block,
            row,
            g,
            offs_d,
            n_mask,
            d_mask,
            stride_vcb,
            stride_vcs,
            stride_vch,
            stride_vcd,
            stride_vsb,
            stride_vss,
            stride_vsh,
            compute,
            QUANTIZED,
        )
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_PART:
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & d_mask[None, :],
        )
    else:
        # partials are [B, NUM_HEADS, num_parts] (m, l) and [B, NUM_HEADS, num_parts, HEAD_DIM]
        idx = (b * NUM_HEADS + heads) * num_parts + p
        tl.store(part_m_ptr + idx, m_i, mask=h_mask)
        tl.store(part_l_ptr + idx, l_i, mask=h_mask)
        tl.store(
            part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=h_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    num_parts,
    stride_ob,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < num_parts
    d_mask = offs_d < HEAD_DIM
    idx = (b * NUM_HEADS + h) * num_parts + offs_p
    # Empty partitions (past this sequence's end, or before its window) hold m = -inf, l = 0.
    m = tl.load(part_m_ptr + idx, mask=p_mask, other=float("-inf"))
    l_part = tl.load(part_l_ptr + idx, mask=p_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    total = tl.sum(l_part * w, 0)
    acc = tl.load(
        part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
        mask=p_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    window,
    first_seq,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    m_block = tl.program_id(0)
    s = first_seq + tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + s)
    num_q = tl.load(query_start_loc_ptr + s + 1) - q_start
    if m_block * BLOCK_M >= num_q:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    first_pos = seq_len - num_q  # position of the sequence's first query token
    kv_h = h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < num_q
    d_mask = offs_d < HEAD_DIM
    q_pos = first_pos + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    compute = q_ptr.dtype.element_ty if QUANTIZED else k_cache_ptr.dtype.element_ty
    q = q.to(compute)

    # keys visible to any row of this tile: [lo, hi)
    hi = tl.minimum(seq_len, first_pos + (m_block + 1) * BLOCK_M)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_pos + m_block * BLOCK_M - window + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + s.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        k_t = _load_k_tile(
            k_cache_ptr,
            k_scale_ptr,
            block,
            row,
            kv_h,
            offs_d,
            n_mask,
            d_mask,
            stride_kcb,
            stride_kcs,
            stride_kch,
            stride_kcd,
            stride_ksb,
            stride_kss,
            stride_ksh,
            compute,
            QUANTIZED,
        )
        s_ij = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s_ij = tl.where(visible, s_ij, float("-inf"))
        # A row may see no key of this tile (causal / window edge): keep its max finite.
        m_new = tl.maximum(m_i, tl.max(s_ij, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        prob = tl.exp2(s_ij - m_use[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        v = _load_v_tile(
            v_cache_ptr,
            v_scale_ptr,
            block,
            row,
            kv_h,
            offs_d,
            n_mask,
            d_mask,
            stride_vcb,
            stride_vcs,
            stride_vch,
            stride_vcd,
            stride_vsb,
            stride_vss,
            stride_vsh,
            compute,
            QUANTIZED,
        )
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


# ---- launchers ------------------------------------------------------------------------------


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, kv_heads, head_dim) of a [num_blocks, block_size, kv_heads, d] cache."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache/v_cache: expected two [num_blocks, block_size, kv_heads, "
            f"head_dim] tensors, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    _, block_size, kv_heads, head_dim = k_cache.shape
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    return block_size, kv_heads, head_dim


def _scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[bool, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(quantized, k_scale, v_scale, their 6 strides) for the kernels. An INT8 cache needs its
    [num_blocks, block_size, kv_heads] scale planes; other caches pass placeholders."""
    if k_cache.dtype != torch.int8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale/v_scale: only an int8 cache has scales, this one is {k_cache.dtype}"
            )
        return False, k_cache, k_cache, (0,) * 6
    if k_scale is None or v_scale is None:
        raise ValueError(
            "k_scale/v_scale: an int8 KV cache needs both scale planes "
            "([num_blocks, block_size, kv_heads], one per token and head)"
        )
    for name, plane in (("k_scale", k_scale), ("v_scale", v_scale)):
        if plane.shape != k_cache.shape[:3] or not plane.dtype.is_floating_point:
            raise ValueError(
                f"{name}: expected a floating [num_blocks, block_size, kv_heads] = "
                f"{list(k_cache.shape[:3])} tensor, got {plane.dtype} "
                f"{list(plane.shape)}"
            )
    return True, k_scale, v_scale, (*k_scale.stride(), *v_scale.stride())


def _block_d(head_dim: int) -> int:
    # head_dim is padded to a power of two >= 16 (masked), so 16/32/64/128 run unpadded
    # and e.g. 80 or 96 still work.
    if head_dim < 1 or head_dim > 512:
        raise ValueError(f"head_dim: {head_dim} unsupported (1..512)")
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def _tile(name: str, value: int) -> int:
    if value < MIN_DOT or value & (value - 1):
        raise ValueError(
            f"{name}: must be a power of two >= {MIN_DOT} (a tl.dot tile dimension), got {value}"
        )
    return value


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 operands: exact IEEE products, not TF32 (the fp32 path is the parity path);
    # 16-bit operands: the backend's default (the setting only concerns fp32 operands).
    return "ieee" if dtype == torch.float32 else None


def _window(sliding_window: int | None) -> tuple[int, bool]:
    if sliding_window is None:
        return 0, False
    if sliding_window < 1:
        raise ValueError(f"sliding_window: must be None or >= 1, got {sliding_window}")
    return int(sliding_window), True


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k/v [T, kv_heads, d] at flat slots slot_mapping [T] (block * block_size + row) of
    k_cache/v_cache [num_blocks, block_size, kv_heads, d]; slots < 0 are skipped.

    An int8 cache (with its k_scale/v_scale planes) stores each token's head quantized as
    `storage.quantize_int8` does: symmetric, scale = max|x| / 127 in float16."""
    block_size, kv_heads, head_dim = _check_cache(k_cache, v_cache)
    quantized, k_scale, v_scale, scale_strides = _scales(k_cache, k_scale, v_scale)
    num_tokens = k.shape[0]
    if k.shape != (num_tokens, kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"write_kv: k/v {tuple(k.shape)}/{tuple(v.shape)} do not match the "
            f"cache's [T, {kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"write_kv: slot_mapping {tuple(slot_mapping.shape)} is not [{num_tokens}]"
        )
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *scale_strides,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        QUANTIZED=quantized,
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    block_n: int = DEFAULT_DECODE_BLOCK_N,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: q [B, heads, d] at position seq_lens[b] - 1 attends to
    positions 0..seq_lens[b] - 1 (within the window) through block_tables [B, max_blocks].

    max_seq_len bounds seq_lens (pass the host-side value to avoid a device sync); it sets the
    number of partitions. partition_size must be a multiple of block_n. An int8 cache is read
    with its k_scale/v_scale planes and dequantized in the kernel (in fp32, then q's dtype).
    A sequence with seq_lens[b] = 0 gets zeros (CUDA graphs pad batches with such rows).
    """
    block_size, kv_heads, head_dim = _check_cache(k_cache, v_cache)
    quantized, k_scale, v_scale, scale_strides = _scales(k_cache, k_scale, v_scale)
    batch, num_heads, qd = q.shape
    if qd != head_dim or num_heads % kv_heads:
        raise ValueError(
            f"decode_attention: q {tuple(q.shape)} does not fit a cache with "
            f"{kv_heads} KV heads of size {head_dim} (heads must be a multiple)"
        )
    block_n = _tile("block_n", block_n)
    if partition_size % block_n:
        raise ValueError(f"partition_size: {partition_size} is not a multiple of block_n={block_n}")
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    window, has_window = _window(sliding_window)
    group = num_heads // kv_heads
    block_d = _block_d(head_dim)
    num_parts = max(1, triton.cdiv(max_seq_len, partition_size))
    single = num_parts == 1
    if single:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty((batch, num_heads, num_parts), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (batch, num_heads, num_parts, head_dim), dtype=torch.float32, device=q.device
        )
    _decode_partition_kernel[(batch, kv_heads, num_parts)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale * LOG2E,
        window,
        num_parts,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *scale_strides,
        block_tables.stride(0),
        *out.stride(),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        BLOCK_SIZE=block_size,
        HAS_WINDOW=has_window,
        SINGLE_PART=single,
        DOT_PRECISION=_dot_precision(q.dtype if quantized else k_cache.dtype),
        QUANTIZED=quantized,
    )
    if not single:
        _decode_reduce_kernel[(batch, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            num_parts,
            *out.stride(),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_P=triton.next_power_of_2(num_parts),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int,
    first_seq: int = 0,
    out: torch.Tensor | None = None,
    block_m: int = DEFAULT_PREFILL_BLOCK_M,
    block_n: int = DEFAULT_PREFILL_BLOCK_N,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed queries q [T, heads, d]; sequence s (first_seq <= s < B) owns rows
    query_start_loc[s]:query_start_loc[s + 1] at positions seq_lens[s] - n .. seq_lens[s] - 1
    and attends causally (and within the window) to the cache through block_tables[s]. Rows
    of sequences before first_seq are left untouched in `out`.

    max_query_len bounds the query count of those sequences (a host-side value; it sizes the
    grid). The query's own K/V must already be in the cache. An int8 cache is read as in
    `decode_attention`.
    """
    block_size, kv_heads, head_dim = _check_cache(k_cache, v_cache)
    quantized, k_scale, v_scale, scale_strides = _scales(k_cache, k_scale, v_scale)
    _, num_heads, qd = q.shape
    if qd != head_dim or num_heads % kv_heads:
        raise ValueError(
            f"prefill_attention: q {tuple(q.shape)} does not fit a cache with "
            f"{kv_heads} KV heads of size {head_dim} (heads must be a multiple)"
        )
    block_m, block_n = _tile("block_m", block_m), _tile("block_n", block_n)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0] - first_seq
    if num_seqs <= 0 or max_query_len <= 0:
        return out
    window, has_window = _window(sliding_window)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        window,
        first_seq,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *scale_strides,
        block_tables.stride(0),
        *out.stride(),
        GROUP=num_heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size,
        HAS_WINDOW=has_window,
        DOT_PRECISION=_dot_precision(q.dtype if quantized else k_cache.dtype),
        QUANTIZED=quantized,
    )
    return out
