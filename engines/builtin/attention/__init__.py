"""Attention implementations, chosen by name (`engine.attention_backend`)."""

from __future__ import annotations

from engines.builtin.attention.dense import DenseAttention, reference_kernel, sdpa_kernel
from engines.builtin.attention.metadata import AttentionMetadata

ATTENTION_BACKENDS = {
    "torch": lambda: DenseAttention("torch", reference_kernel),
    "sdpa": lambda: DenseAttention("sdpa", sdpa_kernel),
}


def make_attention(name: str) -> DenseAttention:
    if name == "auto":
        name = "sdpa"
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ValueError(f"engine.attention_backend: {name!r} is not available; "
                         f"available: auto|{'|'.join(ATTENTION_BACKENDS)}") from None


__all__ = ["ATTENTION_BACKENDS", "AttentionMetadata", "DenseAttention", "make_attention"]
