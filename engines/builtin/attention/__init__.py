"""Attention implementations, chosen by name (`engine.attention_backend`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines.builtin import native
from engines.builtin.attention.dense import (
    AttentionBackend,
    DenseAttention,
    reference_kernel,
    sdpa_kernel,
)
from engines.builtin.attention.metadata import AttentionMetadata
from engines.registry import Registry

#: `engine.attention_backend` -> a function making the backend (heavy ones imported on use).
ATTENTION_BACKENDS = Registry[Callable[[], AttentionBackend]](
    "engine.attention_backend", extra_values=("auto",)
)
ATTENTION_BACKENDS.add("torch", lambda: DenseAttention("torch", reference_kernel))
ATTENTION_BACKENDS.add("sdpa", lambda: DenseAttention("sdpa", sdpa_kernel))


@ATTENTION_BACKENDS.register("triton")
def _triton_attention() -> AttentionBackend:
    """Imported on first use, so the package works where triton is not installed."""
    try:
        from engines.builtin.attention.triton_backend import TritonAttention
    except ImportError as e:
        raise ValueError(
            f"engine.attention_backend: 'triton' needs the triton package ({e}); "
            "available without it: auto|torch|sdpa|cpu"
        ) from e
    return TritonAttention()


@ATTENTION_BACKENDS.register("cpu")
def _cpu_attention() -> DenseAttention:
    from engines.builtin.attention.cpu import CpuAttention

    return CpuAttention()


def resolve_attention(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
    native_kernels: bool = True,
) -> str:
    """`auto`: the engine's C decode kernel where it would run (CPU, float32 K/V, the kernels
    built, `native_kernels`), else sdpa. `cpu` is refused off the CPU."""
    if name == "cpu" and device.type != "cpu":
        raise ValueError(
            f"engine.attention_backend: 'cpu' runs on the CPU only, not on "
            f"{device}; available there: auto|torch|sdpa|triton"
        )
    if name != "auto":
        return name
    if (
        native_kernels
        and device.type == "cpu"
        and dtype == torch.float32
        and kv_cache_dtype != "int8"  # the C kernels read float32 and FP8 K/V
        and native.load() is not None
    ):
        return "cpu"
    return "sdpa"


def make_attention(name: str) -> AttentionBackend:
    return ATTENTION_BACKENDS.get(name)()


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "DenseAttention",
    "make_attention",
    "resolve_attention",
]
