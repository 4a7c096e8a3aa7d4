"""CPU attention: decodes read the KV blocks in place through the engine's own C kernel;
prefills (and what the kernel does not take: INT8 or non-fp32 caches) go the sdpa way.

torch's CPU SDPA serves a decode one (sequence, head) GEMV pair at a time over K/V rows it
reads 256 bytes at a time, 3 KB apart; the kernel walks each sequence's positions and reads
all its heads' K (then V) of a position as one contiguous run, with no gather for paged
blocks, no permutation for out-of-order blocks and no mask for unequal lengths (it stops at
each sequence's length). Measured on the 2-core dev VM, 12 layers of the small preset
(`scripts/bench_cpu_kernels.py`): batch 16 x 48 keys 2.8 vs 3.6 ms, batch 64 x 200 keys 57
vs 75 ms.
"""

from __future__ import annotations

import torch

from engines.builtin import native
from engines.builtin.attention.dense import DenseAttention, sdpa_kernel
from engines.builtin.attention.metadata import AttentionMetadata
from engines.builtin.kv_cache.storage import LayerKVCache


class CpuAttention(DenseAttention):
    def __init__(self) -> None:
        if native.load() is None:
            raise ValueError("engine.attention_backend: 'cpu' needs the engine's C kernels, "
                             f"which could not be built here ({native.reason()}); "
                             "available without them: auto|torch|sdpa")
        super().__init__("cpu", sdpa_kernel)

    def _decode(self, q: torch.Tensor, cache: LayerKVCache | None, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        assert cache is not None, "single-token decodes need a KV cache"
        # resolve_attention keeps this backend on the CPU; the cache's dtype is static
        if cache.quantized or cache.dtype != torch.float32 or q.dtype != torch.float32:
            return super()._decode(q, cache, meta, scale)
        nd = q.shape[0]
        seq_lens, window, longest = meta.seq_lens[:nd], meta.sliding_window, meta.max_seq_len
        if meta.ring:  # every filled slot of the ring is visible, in any order
            if "ring_lens" not in meta.per_step:
                meta.per_step["ring_lens"] = seq_lens.clamp(max=meta.block_size)
            seq_lens, window = meta.per_step["ring_lens"], None
            longest = min(longest, meta.block_size)
        return native.decode_attention(q, cache.k, cache.v, meta.block_tables[:nd], seq_lens,
                                       scale, window, max_seq_len=longest)
