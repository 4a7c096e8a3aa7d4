"""CPU attention through the engine's own C kernels: decodes read the KV blocks in place;
whole prompts (no cached context) attend to their own keys, every prompt of the step in one
call. What the kernels do not take (bf16/fp16, decodes over an INT8 cache, prefill chunks on
top of cached context) goes the sdpa way.

torch's CPU SDPA serves a decode one (sequence, head) GEMV pair at a time over K/V rows it
reads 256 bytes at a time, 3 KB apart; the kernel walks each sequence's positions and reads
all its heads' K (then V) of a position as one contiguous run, with no gather for paged
blocks, no permutation for out-of-order blocks and no mask for unequal lengths (it stops at
each sequence's length); docs/benchmarks.md ("CPU kernels") has the times against sdpa,
from `scripts/bench_cpu_kernels.py`.

For prompts, torch's CPU flash attention runs one call per prompt; the kernel
(`prefill_attention_f32`: two small GEMMs per tile of 32 queries) takes all of the step's
prompts in one call, which pays most where a step holds many short prompts (same section).
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
            raise ValueError(
                "engine.attention_backend: 'cpu' needs the engine's C kernels, "
                f"which could not be built here ({native.reason()}); "
                "available without them: auto|torch|sdpa"
            )
        super().__init__("cpu", sdpa_kernel)

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
        if not self._whole_prompts(meta) or not all(
            t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
            for t in (q, k, v)
        ):
            super()._prefills(q, k, v, cache, meta, scale, out)
            return
        first = meta.query_start_loc_host[meta.num_decodes]
        native.prefill_attention(
            q[first:],
            k[first:],
            v[first:],
            meta.per_step["prompt_starts"],
            scale,
            meta.sliding_window,
            out=out[first:],
        )

    @staticmethod
    def _whole_prompts(meta: AttentionMetadata) -> bool:
        """Whether every prefill of the step is a whole prompt (its context is its own new
        tokens); if so, their row bounds go to meta.per_step["prompt_starts"] for the kernel."""
        if "prompt_starts" not in meta.per_step:
            nd, qsl = meta.num_decodes, meta.query_start_loc_host
            whole = all(
                qsl[i + 1] - qsl[i] == meta.seq_lens_host[i] for i in range(nd, meta.num_seqs)
            )
            meta.per_step["prompt_starts"] = (
                torch.tensor([b - qsl[nd] for b in qsl[nd : meta.num_seqs + 1]], dtype=torch.int32)
                if whole
                else None
            )
        return meta.per_step["prompt_starts"] is not None

    def _decode(
        self, q: torch.Tensor, cache: LayerKVCache | None, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        assert cache is not None, "single-token decodes need a KV cache"
        # resolve_attention keeps this backend on the CPU; the cache's dtype is static
        if cache.scaled or cache.dtype != torch.float32 or q.dtype != torch.float32:
            return super()._decode(q, cache, meta, scale)
        nd = q.shape[0]
        seq_lens, window, longest = meta.seq_lens[:nd], meta.sliding_window, meta.max_seq_len
        if meta.ring:  # every filled slot of the ring is visible, in any order
            if "ring_lens" not in meta.per_step:
                meta.per_step["ring_lens"] = seq_lens.clamp(max=meta.block_size)
            seq_lens, window = meta.per_step["ring_lens"], None
            longest = min(longest, meta.block_size)
        return native.decode_attention(
            q,
            cache.k,
            cache.v,
            meta.block_tables[:nd],
            seq_lens,
            scale,
            window,
            max_seq_len=longest,
            kv_format=native.kv_format(cache.fp8),
        )
