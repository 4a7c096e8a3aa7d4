"""The KV tensors themselves: one pair of [num_blocks, block_size, kv_heads, head_dim] tensors
per layer. A contiguous cache is the special case of one max_model_len-sized block per sequence,
so every attention path reads both layouts the same way."""

from __future__ import annotations

import contextlib
import math
import mmap

import numpy as np
import torch

from engines.base import now_ns


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool = False
) -> torch.Tensor:
    """Zero-filled KV memory. Zeros, not empty: batched decode reads (and masks) positions past
    a short sequence's end, and garbage there could be NaN, which a zero attention weight does
    not cancel.

    On CPU the OS backs memory page by page at first write, and a first write costs far more
    than a later one (20-40x for a prefill's K write; docs/benchmarks.md, "Figures behind
    design choices"). `prefault` maps every page now, as a GPU's memory is there once
    allocated, so that no measured step pays for it; without it the pages come lazily from
    calloc (through numpy): a large reservation costs nothing until written. Prefaulted
    memory asks for transparent huge pages first (madvise: in THP's "madvise" mode, the
    default on many distributions, only regions that ask get them): decode attention streams
    the whole cache every step, and with 2 MB pages instead of 4 KB it reads faster, its TLB
    misses gone (same section).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = itemsize * math.prod(shape)
    if prefault and nbytes:
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
            memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(OSError):  # a kernel without THP: 4 KB pages
                memory.madvise(mmap.MADV_HUGEPAGE)
            tensor = torch.frombuffer(memory, dtype=dtype).view(shape)
            return tensor.zero_()  # writing every page maps it now
        return torch.zeros(shape, dtype=dtype)  # writes every page
    raw = np.zeros(shape, dtype=np.dtype(f"u{itemsize}"))
    return torch.from_numpy(raw).view(dtype)


INT8_SCALE_DTYPE = torch.float16  # per-token, per-head scale of an INT8 KV cache

#: engine.kv_cache_dtype -> the dtype K/V are stored in (auto: the compute dtype). INT8 keeps a
#: scale per token and head; FP8 (fp8 is e4m3, as vLLM's) keeps the values themselves, with
#: scale 1, vLLM's default without calibrated scales, and the few past the format's largest
#: value (448 for e4m3) clamped to it.
KV_STORAGE = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPES = ("auto", *KV_STORAGE)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 per (token, head): x [..., d] -> (q int8 [..., d], scale [...])."""
    scale = x.detach().abs().amax(dim=-1).float().clamp(min=1e-8) / 127.0
    q = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale.to(INT8_SCALE_DTYPE)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def to_fp8(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """x in the FP8 format `fp8`, the values past its largest clamped (not NaN or inf)."""
    top = torch.finfo(fp8).max
    return x.clamp(-top, top).to(fp8)


def kv_element_bytes(dtype: torch.dtype, head_dim: int, kv_cache_dtype: str) -> float:
    """Bytes per K (or V) element per head, scale planes included (INT8: d + a 2-byte scale)."""
    if kv_cache_dtype == "int8":
        return (head_dim + INT8_SCALE_DTYPE.itemsize) / head_dim
    if kv_cache_dtype in KV_STORAGE:
        return KV_STORAGE[kv_cache_dtype].itemsize
    return torch.finfo(dtype).bits // 8


class LayerKVCache:
    """`kv_cache_dtype` (KV_CACHE_DTYPES): int8 keeps INT8 values with a float16 scale plane
    per token and head, fp8 FP8 values; writes quantize, reads (gather) widen to the compute
    dtype. `quantized`: the values are not in the compute dtype; `scaled`: with scale planes;
    `fp8`: the FP8 format whose bytes k and v hold.
    `prefault`: see zeros()."""

    #: write() stores each row at its flat slot of k/v and nothing else, so a kernel that has
    #: the rows at hand (the C rotary kernel) may store them in its place; a subclass whose
    #: write does more (or other) says False
    stores_by_slot = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        prefault: bool = False,
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {kv_cache_dtype!r}; allowed: {'|'.join(KV_CACHE_DTYPES)}"
            )
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = kv_cache_dtype != "auto"
        self.scaled = kv_cache_dtype == "int8"
        # FP8 values are kept as their bytes: torch's CPU index ops do not take float8 dtypes
        self.fp8 = KV_STORAGE[kv_cache_dtype] if kv_cache_dtype.startswith("fp8") else None
        store = torch.uint8 if self.fp8 else KV_STORAGE.get(kv_cache_dtype, dtype)
        self.k = zeros(shape, store, device, prefault)
        self.v = zeros(shape, store, device, prefault)
        if self.scaled:
            self.k_scale = zeros(shape[:3], INT8_SCALE_DTYPE, device, prefault)
            self.v_scale = zeros(shape[:3], INT8_SCALE_DTYPE, device, prefault)
        self.block_size = block_size
        self.gather_ns = 0  # time spent in gather since the runner last reset it

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's K/V [T, kv_heads, d] at their flat slots."""
        if self.scaled:
            (k, k_scale), (v, v_scale) = quantize_int8(k), quantize_int8(v)
            self.k_scale.view(-1, self.k.shape[2]).index_copy_(0, slot_mapping, k_scale)
            self.v_scale.view(-1, self.v.shape[2]).index_copy_(0, slot_mapping, v_scale)
        elif self.fp8 is not None:
            k, v = to_fp8(k, self.fp8).view(torch.uint8), to_fp8(v, self.fp8).view(torch.uint8)
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slot_mapping, k)
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slot_mapping, v)

    def gather(
        self, block_tables: torch.Tensor, length: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first `length` positions of each sequence: [B, length, kv_heads, d].

        On CPU the dense attention path copies the context out of the cache; with paged blocks
        that copy is a gather a GPU kernel would not do (it reads blocks in place), so its time
        is measured apart (`gather_ns`, reported per step) rather than charged to paging."""
        start = now_ns()
        planes = self.planes
        if length <= block_size:  # one block covers it (always so for the contiguous layout)
            blocks = block_tables[:, 0]
            out = [p[blocks, :length] for p in planes]
        else:
            blocks = block_tables[:, : -(-length // block_size)]
            out = [p[blocks].flatten(1, 2)[:, :length] for p in planes]
        if self.scaled:
            out = [
                dequantize_int8(out[0], out[2], self.dtype),
                dequantize_int8(out[1], out[3], self.dtype),
            ]
        elif self.fp8 is not None:
            out = [out[0].view(self.fp8).to(self.dtype), out[1].view(self.fp8).to(self.dtype)]
        self.gather_ns += now_ns() - start
        return out[0], out[1]

    def readable_in_place(self, length: int) -> bool:
        """Whether `block_range_view` can serve contexts of `length`: not INT8 or FP8 values
        (they need widening), not past one block."""
        return not self.quantized and length <= self.block_size

    def block_range_view(
        self, first: int, count: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of blocks [first, first + count), first `length` positions, as views into the
        cache (no copy): [count, length, kv_heads, d]. Needs `readable_in_place(length)`."""
        assert self.readable_in_place(length)
        return self.k[first : first + count, :length], self.v[first : first + count, :length]

    @property
    def planes(self) -> list[torch.Tensor]:
        """Every tensor indexed by block: K, V, and an INT8 cache's scale planes."""
        return [self.k, self.v, *((self.k_scale, self.v_scale) if self.scaled else ())]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: blocks `src` into blocks `dst`, scale planes included."""
        for plane in self.planes:
            plane[dst] = plane[src]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes)


def gather_blocks(caches: list[LayerKVCache], blocks: list[int]) -> torch.Tensor:
    """`blocks`, over every layer's planes, as one uint8 tensor in host memory, a row per block
    (what a prefill instance hands a decode instance). One gather per plane, whatever the
    number of blocks."""
    index = torch.tensor(blocks, device=caches[0].k.device)
    parts = [
        plane[index].reshape(len(blocks), -1).view(torch.uint8)
        for cache in caches
        for plane in cache.planes
    ]
    return torch.cat(parts, dim=1).cpu()


def read_blocks(caches: list[LayerKVCache], blocks: list[int]) -> list[torch.Tensor]:
    """Each of `blocks` as one flat uint8 tensor in host memory: what a KV tier keeps
    (tiers.py); each its own memory, since a tier frees them one by one."""
    return [row.clone() for row in gather_blocks(caches, blocks)]


def write_blocks(
    caches: list[LayerKVCache], blocks: list[int], payloads: list[torch.Tensor]
) -> None:
    """The inverse of read_blocks: each payload's bytes into its block of every plane."""
    rows = torch.stack(payloads).to(caches[0].k.device)
    index = torch.tensor(blocks, device=rows.device)
    offset = 0
    for cache in caches:
        for plane in cache.planes:
            shape = plane.shape[1:]
            size = shape.numel() * plane.element_size()
            part = rows[:, offset : offset + size].contiguous().view(plane.dtype)
            plane[index] = part.view(len(blocks), *shape)
            offset += size
    if offset != rows.shape[1]:
        raise ValueError(f"a {rows.shape[1]}-byte KV block is not the cache's {offset} bytes")
