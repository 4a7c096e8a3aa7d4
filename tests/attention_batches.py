"""A packed attention step built by hand, for testing attention backends against each other."""

from __future__ import annotations

import math

import torch

from engines.builtin.attention import AttentionMetadata
from engines.builtin.kv_cache import LayerKVCache


def shuffled_block_tables(
    seqs: list[tuple[int, int]], block_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Block tables for seqs[i] = (context length, new tokens), the blocks handed out in a
    random order (so a table is not the identity), 3 blocks spare; and the pool's size."""
    need = [math.ceil(length / block_size) for length, _ in seqs]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    return tables, num_blocks


def step_metadata(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    tables: torch.Tensor,
    block_size: int,
    window: int | None,
    device: str,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The flat cache slot of each new token, and the step's metadata."""
    lens = [length for length, _ in seqs]
    qlens = [n for _, n in seqs]
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    positions = torch.cat([torch.arange(length - n, length) for length, n in seqs])
    seq_index = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(qlens))
    slots = (
        tables[seq_index, positions // block_size].long() * block_size + positions % block_size
    ).to(device)
    meta = AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slots,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_start_loc_host=qsl,
        seq_lens_host=lens,
        num_decodes=num_decodes,
        max_seq_len=max(lens),
        block_size=block_size,
        sliding_window=window,
        use_cache=True,
    )
    return slots, meta


def make_batch(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    seed: int = 0,
    device: str = "cpu",
):
    """A packed step: seqs[i] = (context length after this step, new tokens), decodes first.

    Blocks are handed out in a random order (so block tables are not the identity), the
    cache starts full of random values (so any read past a sequence's end or window shows
    up), and this step's K/V are written the way the model layer writes them.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    tables, num_blocks = shuffled_block_tables(seqs, block_size, gen)
    cache = LayerKVCache(
        num_blocks, block_size, num_kv_heads, head_dim, dtype, torch.device(device)
    )
    cache.k.copy_(randn(*cache.k.shape))
    cache.v.copy_(randn(*cache.v.shape))
    slots, meta = step_metadata(seqs, num_decodes, tables, block_size, window, device)
    total = meta.query_start_loc_host[-1]
    q, k, v = (
        randn(total, num_heads, head_dim),
        randn(total, num_kv_heads, head_dim),
        randn(total, num_kv_heads, head_dim),
    )
    cache.write(k, v, slots)
    return q, k, v, cache, meta
