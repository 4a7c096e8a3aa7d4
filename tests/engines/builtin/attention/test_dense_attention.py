"""Dense decode attention reads a contiguous cache in place when the slots form one range,
and gives the same output as the gather path and the reference."""

from __future__ import annotations

import pytest
import torch

from engines.builtin.attention import AttentionMetadata, make_attention
from engines.builtin.kv_cache.storage import LayerKVCache

HEADS, KV_HEADS, DIM, SLOT_LEN = 4, 2, 8, 32


def decode_meta(slots: list[int], lens: list[int], window: int | None = None) -> AttentionMetadata:
    nd = len(slots)
    return AttentionMetadata(
        positions=torch.tensor([n - 1 for n in lens]),
        slot_mapping=torch.tensor([s * SLOT_LEN + n - 1 for s, n in zip(slots, lens, strict=True)]),
        query_start_loc=torch.arange(nd + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([[s] for s in slots], dtype=torch.int32),
        query_start_loc_host=list(range(nd + 1)),
        seq_lens_host=lens,
        num_decodes=nd,
        max_seq_len=max(lens),
        block_size=SLOT_LEN,
        sliding_window=window,
        use_cache=True,
    )


def expected(
    q: torch.Tensor,
    cache: LayerKVCache,
    slots: list[int],
    lens: list[int],
    window: int | None = None,
) -> torch.Tensor:
    rows = []
    for i, (slot, n) in enumerate(zip(slots, lens, strict=True)):
        first = 0 if window is None else max(0, n - window)  # keys n-window .. n-1 visible
        k = cache.k[slot, first:n].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [n, h, d]
        v = cache.v[slot, first:n].repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i], k) * DIM**-0.5
        rows.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(rows)


def random_cache(seed: int) -> LayerKVCache:
    gen = torch.Generator().manual_seed(seed)
    cache = LayerKVCache(6, SLOT_LEN, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


@pytest.mark.parametrize("backend", ["torch", "sdpa", "cpu"])
@pytest.mark.parametrize(
    ("slots", "lens", "window", "in_place"),
    [
        ([2, 0, 3, 1], [5, 17, 9, 30], None, True),  # one range, permuted
        ([4, 0, 2], [5, 17, 9], None, False),  # gaps: gathered
        ([1, 2, 3], [5, 17, 9], None, True),  # one range in order: no permutation
        ([0, 1, 2], [9, 9, 9], None, True),  # and equally long: no mask either
        ([3, 1, 2], [5, 17, 30], 8, True),  # a sliding window, read in place
        ([5], [21], 8, True),  # one sequence with a window still needs the mask
    ],
)
def test_decode_in_place_matches_gather_and_reference(
    backend: str, slots: list[int], lens: list[int], window: int | None, in_place: bool
) -> None:
    cache = random_cache(0)
    q = torch.randn(len(slots), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    kv_new = torch.zeros(len(slots), KV_HEADS, DIM)  # decodes read only the cache
    out = make_attention(backend)(
        q, kv_new, kv_new, cache, decode_meta(slots, lens, window), DIM**-0.5
    )
    torch.testing.assert_close(out, expected(q, cache, slots, lens, window), rtol=1e-5, atol=1e-5)
    # in place: nothing copied out of the cache (the C kernel reads every layout in place)
    assert (cache.gather_ns == 0) is (in_place or backend == "cpu")


@pytest.mark.parametrize("slots", [[2, 0, 3, 1], [4, 0, 2]])
def test_layers_of_one_step_share_the_plan_and_read_their_own_cache(slots: list[int]) -> None:
    """What the first layer derives (ordering, mask) is reused by the next layer through
    `meta.per_step`; each layer still reads its own cache."""
    lens = [5, 17, 9, 30][: len(slots)]
    meta = decode_meta(slots, lens)
    attention = make_attention("sdpa")
    kv_new = torch.zeros(len(slots), KV_HEADS, DIM)
    for layer in range(2):
        cache = random_cache(10 + layer)
        q = torch.randn(len(slots), HEADS, DIM, generator=torch.Generator().manual_seed(layer))
        out = attention(q, kv_new, kv_new, cache, meta, DIM**-0.5)
        torch.testing.assert_close(out, expected(q, cache, slots, lens), rtol=1e-5, atol=1e-5)
        assert meta.per_step  # filled by the first layer
