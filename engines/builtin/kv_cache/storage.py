"""The KV tensors themselves: one pair of [num_blocks, block_size, kv_heads, head_dim] tensors
per layer. A contiguous cache is the special case of one max_model_len-sized block per sequence,
so every attention path reads both layouts the same way."""

from __future__ import annotations

import numpy as np
import torch

from engines.base import now_ns


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled KV memory. On CPU it comes from calloc (through numpy), so the OS maps
    zero pages lazily and a large reservation costs nothing until written, as on a GPU it
    costs nothing to compute; torch.zeros would memset gigabytes up front. Zeros, not empty:
    batched decode reads (and masks) positions past a short sequence's end, and garbage
    there could be NaN, which a zero attention weight does not cancel."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(shape, dtype=np.dtype(f"u{itemsize}"))
    return torch.from_numpy(raw).view(dtype)


class LayerKVCache:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)
        self.block_size = block_size
        self.gather_ns = 0  # time spent in gather since the runner last reset it
    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's K/V [T, kv_heads, d] at their flat slots."""
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slot_mapping, k)
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slot_mapping, v)

    def gather(self, block_tables: torch.Tensor, length: int,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first `length` positions of each sequence: [B, length, kv_heads, d].

        On CPU the dense attention path copies the context out of the cache; with paged blocks
        that copy is a gather a GPU kernel would not do (it reads blocks in place), so its time
        is measured apart (`gather_ns`, reported per step) rather than charged to paging."""
        start = now_ns()
        if length <= block_size:  # one block covers it (always so for the contiguous layout)
            blocks = block_tables[:, 0]
            k, v = self.k[blocks, :length], self.v[blocks, :length]
        else:
            blocks = block_tables[:, :-(-length // block_size)]
            k = self.k[blocks].flatten(1, 2)[:, :length]
            v = self.v[blocks].flatten(1, 2)[:, :length]
        self.gather_ns += now_ns() - start
        return k, v

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
