"""Attention implementations, chosen by name (`engine.attention_backend`)."""

from __future__ import annotations

from engines.builtin.attention.dense import DenseAttention, reference_kernel, sdpa_kernel
from engines.builtin.attention.metadata import AttentionMetadata


def _triton_attention():
    """Imported on first use, so the package works where triton is not installed."""
    try:
        from engines.builtin.attention.triton_backend import TritonAttention
    except ImportError as e:
        raise ValueError(f"engine.attention_backend: 'triton' needs the triton package ({e}); "
                         "available without it: auto|torch|sdpa") from e
    return TritonAttention()


ATTENTION_BACKENDS = {
    "torch": lambda: DenseAttention("torch", reference_kernel),
    "sdpa": lambda: DenseAttention("sdpa", sdpa_kernel),
    "triton": _triton_attention,
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
