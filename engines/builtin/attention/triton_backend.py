"""`attention_backend=triton`: the packed batch's attention straight from the paged KV cache.

Same call as `DenseAttention`: the model layer has already written this step's K/V into the
cache, so both kernels read every key (the step's own included) through the block tables, with
no dense gather. Decodes (the first `num_decodes` sequences, one token each) go to the split-K
decode kernel, all prefills and prefill chunks to the paged prefill kernel in one launch. Both
kernels write into one output tensor. An INT8 cache (`kv_cache_dtype=int8`) is read with its
scale planes and dequantized inside the kernels; `TritonKVCache` writes K/V with the Triton
write kernel (quantizing in the kernel for INT8), and skips slots < 0 (padding rows).

Needs a CUDA device, or the Triton interpreter on CPU (TRITON_INTERPRET=1 in the environment
before triton kernels are first imported; slow, for tests).
"""

from __future__ import annotations

import torch

from engines.builtin.attention import triton_kernels
from engines.builtin.attention.metadata import AttentionMetadata
from engines.builtin.kv_cache.storage import LayerKVCache


class TritonAttention:
    name = "triton"
    fixed_shapes = True
    caps_scores = False  # its kernels take no soft cap (Gemma 2's layers are refused)
    reads_fp8_kv = False  # its kernels load float or INT8 K/V tiles

    @property
    def kv_cache_class(self) -> type[LayerKVCache]:
        """The Triton write kernel's cache (INT8 quantized in-kernel; padding slots skipped)."""
        return TritonKVCache

    def __init__(
        self,
        partition_size: int = triton_kernels.DEFAULT_PARTITION_SIZE,
        decode_block_n: int = triton_kernels.DEFAULT_DECODE_BLOCK_N,
        prefill_block_m: int = triton_kernels.DEFAULT_PREFILL_BLOCK_M,
        prefill_block_n: int = triton_kernels.DEFAULT_PREFILL_BLOCK_N,
    ) -> None:
        self.partition_size = partition_size
        self.decode_block_n = decode_block_n
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache | None,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, h, d] (k/v [T, kvh, d], already in the cache) -> [T, h, d]."""
        if cache is None or not meta.use_cache:
            raise RuntimeError(
                "attention_backend=triton reads K/V from the KV cache, but this step has none "
                "(kv_cache=none); use kv_cache=contiguous|paged, or attention_backend=sdpa"
            )
        if meta.ring:
            raise RuntimeError(
                "attention_backend=triton reads positions through block tables, but a "
                "sliding-window model's contiguous cache is a rotated ring; use kv_cache=paged "
                "(which releases blocks outside the window) or attention_backend=sdpa"
            )
        self._check_device(q)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        lens = meta.seq_lens_host
        scales = _scales(cache)
        if nd:
            triton_kernels.decode_attention(
                q[:nd],
                cache.k,
                cache.v,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                meta.sliding_window,
                max_seq_len=max(lens[:nd]),
                out=out[:nd],
                partition_size=self.partition_size,
                block_n=self.decode_block_n,
                **scales,
            )
        if meta.num_seqs > nd:
            qsl = meta.query_start_loc_host
            max_query_len = max(qsl[i + 1] - qsl[i] for i in range(nd, meta.num_seqs))
            triton_kernels.prefill_attention(
                q,
                cache.k,
                cache.v,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                meta.sliding_window,
                max_query_len=max_query_len,
                first_seq=nd,
                out=out,
                block_m=self.prefill_block_m,
                block_n=self.prefill_block_n,
                **scales,
            )
        return out

    @staticmethod
    def write_kv(
        k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor
    ) -> None:
        """The Triton equivalent of `cache.write(k, v, slot_mapping)` (slots < 0 skipped)."""
        triton_kernels.write_kv(k, v, cache.k, cache.v, slot_mapping, **_scales(cache))

    @staticmethod
    def _check_device(q: torch.Tensor) -> None:
        if q.device.type != "cuda" and not triton_kernels.interpreting():
            raise RuntimeError(
                f"attention_backend=triton: tensors are on {q.device}, and Triton kernels run "
                "on CUDA only; use device=cuda, or attention_backend=sdpa on CPU (tests: set "
                "TRITON_INTERPRET=1 before triton kernels are imported)"
            )


def _scales(cache: LayerKVCache) -> dict[str, torch.Tensor]:
    """The scale planes the kernels need for an INT8 cache (none otherwise)."""
    if not cache.scaled:
        return {}
    return {"k_scale": cache.k_scale, "v_scale": cache.v_scale}


class TritonKVCache(LayerKVCache):
    """A layer's KV cache written by the Triton kernel: one launch per layer and step (INT8
    quantization included), and slots < 0 are skipped, so padding rows (CUDA graph buckets)
    can run through the model without storing anything."""

    stores_by_slot = False  # its own kernel writes, not the plain row store

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        TritonAttention.write_kv(k, v, self, slot_mapping)
