"""Plain torch versions of the three paged-KV operations the Triton kernels implement.

Written for reading, not speed: every sequence is handled on its own, and its keys are
gathered one position at a time through its block table
(slot = block_tables[seq, pos // block_size] * block_size + pos % block_size), exactly as the
kernels address the cache. Shapes follow `LayerKVCache`: k_cache/v_cache are
[num_blocks, block_size, kv_heads, head_dim]. Sliding windows use Mistral's semantics: key j is
visible from query i when j <= i and i - j < window.
"""

from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k/v [T, kv_heads, d] at their flat slots; slots < 0 (padding) are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..length-1 of one sequence: [length] int64."""
    pos = torch.arange(length, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def attend(
    q: torch.Tensor,
    query_pos: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [n, h, d] at positions query_pos [n] over keys/values [L, kvh, d] at positions
    0..L-1, causal and windowed, in fp32 -> [n, h, d] in q's dtype."""
    groups = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(groups, dim=1)  # [L, h, d]
    values = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale
    key_pos = torch.arange(keys.shape[0], device=q.device)
    visible = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        visible &= query_pos[:, None] - key_pos[None, :] < window
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), values)
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, h, d], at position seq_lens[b] - 1 -> [B, h, d]."""
    block_size = k_cache.shape[1]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        slots = context_slots(block_tables[b], length, block_size)
        pos = torch.tensor([length - 1], device=q.device)
        out[b] = attend(q[b : b + 1], pos, flat_k[slots], flat_v[slots], scale, sliding_window)[0]
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
    first_seq: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed queries q [T, h, d]: sequence s's tokens are rows query_start_loc[s]:[s+1], at
    positions seq_lens[s] - n .. seq_lens[s] - 1 (a whole prompt, a chunk of one, or the
    uncached tail after a prefix-cache hit); they attend to positions 0..their own through the
    cache. Sequences before `first_seq` are left alone in `out`."""
    block_size = k_cache.shape[1]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.zeros_like(q) if out is None else out
    qsl = query_start_loc.tolist()
    for s, length in enumerate(seq_lens.tolist()):
        if s < first_seq:
            continue
        start, end = qsl[s], qsl[s + 1]
        pos = torch.arange(length - (end - start), length, device=q.device)
        slots = context_slots(block_tables[s], length, block_size)
        out[start:end] = attend(
            q[start:end], pos, flat_k[slots], flat_v[slots], scale, sliding_window
        )
    return out
