"""Rotary position embeddings (the non-interleaved "rotate half" layout of Hugging Face Llama),
with Llama-3.1 and linear frequency scaling."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if rope_type == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """The cos|sin table of RoPE over every position; `apply_rotary` rotates q and k."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        # cos|sin side by side so one gather per step serves both.
        self.register_buffer("cos_sin_table", torch.cat([angles.cos(), angles.sin()], dim=-1),
                             persistent=False)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation at `positions`: looked up once per step, applied in every layer."""
        cos, sin = self.cos_sin_table[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return Rotation(torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))


class Rotation(NamedTuple):
    """One step's RoPE factors, [T, 1, d] each, for the rotate-half layout."""

    cos: torch.Tensor  # cos | cos
    sin_signed: torch.Tensor  # -sin | sin


def apply_rotary(qk: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """qk [T, q_heads + kv_heads, d] (halves x1, x2): queries and keys rotated together.

    x1*cos - x2*sin | x2*cos + x1*sin, written as qk*(cos|cos) + (x2|x1)*(-sin|sin): the same
    roundings in four ops instead of seven."""
    swapped = qk.roll(qk.shape[-1] // 2, dims=-1)
    return qk * rotation.cos + swapped * rotation.sin_signed
