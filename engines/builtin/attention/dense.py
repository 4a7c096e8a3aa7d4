"""Attention over a packed batch with a dense K/V gather: the CPU path, and the reference.

Decodes are batched into one call over keys gathered up to the longest context; each prefill
(or prefill chunk) is one call over its own context. Two kernels share this orchestration:
`torch` (explicit softmax(QK^T)V, the readable reference) and `sdpa`
(torch.nn.functional.scaled_dot_product_attention, the fast default on CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engines.builtin.attention.metadata import AttentionMetadata
from engines.builtin.kv_cache.storage import LayerKVCache

# q [B, h, n, d], k/v [B, kvh, L, d], mask [B or 1, 1, n, L] (True = attend) or None -> [B, h, n, d]
Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float, bool], torch.Tensor
]


class AttentionBackend(Protocol):
    """What a model layer calls: DenseAttention (and CpuAttention), TritonAttention, and
    torch.compile's eager wrapper (cuda_graphs._EagerAttention)."""

    name: str

    @property
    def fixed_shapes(self) -> bool:
        """Whether a decode step keeps every tensor's shape (CUDA graphs can capture it)."""

    @property
    def kv_cache_class(self) -> type[LayerKVCache]:
        """The layer KV cache its kernels read and write."""

    @property
    def caps_scores(self) -> bool:
        """Whether it attends with AttentionMetadata.logit_softcap (Gemma 2's soft cap)."""

    @property
    def reads_fp8_kv(self) -> bool:
        """Whether it reads an FP8 KV cache (engine.kv_cache_dtype=fp8*)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache | None,
        meta: AttentionMetadata,
        scale: float,
        /,
    ) -> torch.Tensor: ...


def reference_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if softcap is not None:  # Gemma 2's soft cap, as Hugging Face applies it
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def sdpa_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )


def _window_mask(
    query_pos: torch.Tensor, length: int, seq_lens: torch.Tensor | None, window: int | None
) -> torch.Tensor:
    """[..., n, L] mask: causal, within each sequence's length, within the sliding window."""
    keys = torch.arange(length, device=query_pos.device)
    mask = keys <= query_pos.unsqueeze(-1)
    if seq_lens is not None:
        mask = mask & (keys < seq_lens.view(-1, 1, 1))
    if window is not None:
        # Hugging Face's Mistral semantics: key j is visible from query i when i - j < window.
        mask = mask & (keys > query_pos.unsqueeze(-1) - window)
    return mask


@dataclass
class InPlaceDecode:
    """How a step's decodes read the cache in place; the same in every layer."""

    first: int  # the lowest block of the range
    order: torch.Tensor | None  # row i of the batch is block first + order[i]; None: i
    mask: torch.Tensor | None  # [B, 1, 1, L] in block order; None: every key is visible


def plan_in_place_decode(
    meta: AttentionMetadata, cache: LayerKVCache, nd: int, length: int
) -> InPlaceDecode | None:
    """None when the cache cannot be read in place or the decodes' blocks are not one range."""
    if not cache.readable_in_place(length):
        return None
    blocks = meta.block_tables[:nd, 0]
    first = int(blocks.min())
    # one block per row: a range of nd distinct blocks (speculative verification gives a
    # sequence's rows the same block, which a range with gaps could otherwise hide)
    if int(blocks.max()) - first + 1 != nd or int(torch.unique(blocks).numel()) != nd:
        return None
    relative = (blocks - first).long()
    order = None if bool((relative == torch.arange(nd, device=blocks.device)).all()) else relative
    lens = meta.seq_lens[:nd].long()
    if order is not None:
        lens = torch.empty_like(lens).index_copy_(0, order, lens)
    return InPlaceDecode(first, order, decode_mask(meta, nd, length, lens))


def decode_mask(
    meta: AttentionMetadata, nd: int, length: int, lens: torch.Tensor
) -> torch.Tensor | None:
    """[B, 1, 1, L] (True = attend) for decodes padded to `length` keys, rows in the order of
    `lens`; None when every key is visible: all contexts `length` long and no window."""
    if meta.sliding_window is None and len(set(meta.seq_lens_host[:nd])) == 1:
        return None
    return _window_mask((lens - 1).view(nd, 1), length, lens, meta.sliding_window).unsqueeze(1)


@functools.cache
def softcapped(cap: float | None) -> DenseAttention:
    """The reference kernel with Gemma 2's soft cap on the scores: neither sdpa nor the C
    kernels take one, so soft-capped layers attend this way on every backend but Triton."""
    return DenseAttention("torch", functools.partial(reference_kernel, softcap=cap), cap)


class DenseAttention:
    fixed_shapes = False  # the K/V gather changes shape every step
    kv_cache_class = LayerKVCache
    caps_scores = True  # through `softcapped` where its own kernel does not
    reads_fp8_kv = True  # the gather widens an FP8 cache (and the C kernel reads it)

    def __init__(self, name: str, kernel: Kernel, softcap: float | None = None) -> None:
        """`softcap`: the soft cap `kernel` applies (layers whose metadata asks for another
        go through `softcapped`)."""
        self.name = name
        self.kernel = kernel
        self.softcap = softcap

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache | None,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, h, d], k/v [T, kvh, d] for this step's tokens -> [T, h, d]."""
        if meta.logit_softcap != self.softcap:
            return softcapped(meta.logit_softcap)(q, k, v, cache, meta, scale)
        nd = meta.num_decodes
        if nd and nd == meta.num_seqs:
            return self._decode(q, cache, meta, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta, scale)
        self._prefills(q, k, v, cache, meta, scale, out)
        return out

    def _prefills(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache | None,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """The step's prefills (rows past the decodes) into `out`, one call per sequence."""
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        for i in range(meta.num_decodes, meta.num_seqs):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], lens[i], i, cache, meta, scale
            )

    def _decode(
        self, q: torch.Tensor, cache: LayerKVCache | None, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert cache is not None, "single-token decodes need a KV cache"
        nd = q.shape[0]
        if meta.ring:  # every slot of the ring is inside the window; only fill varies
            filled = [min(n, meta.block_size) for n in meta.seq_lens_host[:nd]]
            keys, values = cache.gather(meta.block_tables[:nd], max(filled), meta.block_size)
            mask = None
            if len(set(filled)) > 1:
                lens = torch.tensor(filled, device=q.device)
                mask = (torch.arange(max(filled), device=q.device) < lens[:, None])[:, None, None]
            return self._attend_decodes(q, keys, values, mask, scale)
        lengths = meta.seq_lens_host[:nd]
        length = max(lengths)
        in_place = self._decode_in_place(q, cache, meta, length, scale)
        if in_place is not None:
            return in_place
        if nd > 1 and 2 * sum(lengths) < nd * length:
            # Contexts of very different lengths: padding every gather to the longest would
            # copy and attend mostly padding, so each sequence attends to its own context.
            return torch.cat(
                [self._decode_one(q[i : i + 1], cache, meta, i, scale) for i in range(nd)]
            )
        keys, values = cache.gather(meta.block_tables[:nd], length, meta.block_size)
        if "decode_mask" not in meta.per_step:
            meta.per_step["decode_mask"] = decode_mask(meta, nd, length, meta.seq_lens[:nd].long())
        return self._attend_decodes(q, keys, values, meta.per_step["decode_mask"], scale)

    def _decode_in_place(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        length: int,
        scale: float,
    ) -> torch.Tensor | None:
        """Decodes whose contexts each fit one block (the contiguous layout: one slot per
        sequence) and whose blocks form one range are attended through a view of the cache,
        with no gather: the queries are put in block order and the outputs put back.

        A gather copies every context on every layer of every step, which costs more than the
        attention itself (docs/benchmarks.md, "Figures behind design choices").
        None when the blocks are not one range or the cache cannot be read in place.
        """
        nd = q.shape[0]
        if "in_place_decode" not in meta.per_step:
            meta.per_step["in_place_decode"] = plan_in_place_decode(meta, cache, nd, length)
        plan: InPlaceDecode | None = meta.per_step["in_place_decode"]
        if plan is None:
            return None
        keys, values = cache.block_range_view(plan.first, nd, length)
        if plan.order is not None:
            q = torch.empty_like(q).index_copy_(0, plan.order, q)
        out = self._attend_decodes(q, keys, values, plan.mask, scale)
        return out if plan.order is None else out[plan.order]

    def _decode_one(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        index: int,
        scale: float,
    ) -> torch.Tensor:
        length = meta.seq_lens_host[index]
        keys, values = cache.gather(meta.block_tables[index : index + 1], length, meta.block_size)
        mask = None
        if meta.sliding_window is not None:
            query_pos = torch.tensor([[length - 1]], device=q.device)
            mask = _window_mask(query_pos, length, None, meta.sliding_window).unsqueeze(1)
        return self._attend_decodes(q, keys, values, mask, scale)

    def _attend_decodes(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence: q [B, h, d] over keys/values [B, L, kvh, d] -> [B, h, d]."""
        out = self.kernel(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask, scale, False
        )
        return out.squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        length: int,
        index: int,
        cache: LayerKVCache | None,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        n = q.shape[0]
        if meta.ring and n != length:
            raise ValueError(
                "a contiguous ring-buffer KV cache cannot serve a prefill on top "
                "of cached context (chunked prefill); use kv_cache=paged"
            )
        if n == length or cache is None:
            keys, values = k, v  # no earlier context: attend to this chunk's own keys
        else:
            keys, values = cache.gather(
                meta.block_tables[index : index + 1], length, meta.block_size
            )
            keys, values = keys[0], values[0]
        causal, mask = True, None
        if meta.sliding_window is not None or n != length:
            causal = False
            query_pos = torch.arange(length - n, length, device=q.device)
            mask = _window_mask(query_pos, length, None, meta.sliding_window)
        out = self.kernel(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            mask,
            scale,
            causal,
        )
        return out[0].transpose(0, 1)
