"""Rotary position embeddings (the non-interleaved "rotate half" layout of Hugging Face Llama),
with Llama-3.1 and linear frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
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

    cos_sin_table: torch.Tensor  # a buffer, registered in __init__

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        # cos|sin side by side so one gather per step serves both.
        self.register_buffer(
            "cos_sin_table", torch.cat([angles.cos(), angles.sin()], dim=-1), persistent=False
        )

    def rotation(self, positions: torch.Tensor) -> Rotation:
        """The rotation at `positions`, shared by every layer of a step."""
        return Rotation(self.cos_sin_table, positions)


class Rotation:
    """One step's rotary positions: the cos|sin table and the positions (what the C kernel
    reads), and the torch path's factors, looked up once, on first use, for every layer."""

    def __init__(self, table: torch.Tensor, positions: torch.Tensor) -> None:
        self.table = table  # [max_positions, d]: cos | sin of each position's d/2 angles
        self.positions = positions  # [T] int64
        self._factors: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos | cos, -sin | sin), [T, 1, d] each, for the rotate-half layout."""
        if dtype not in self._factors:
            cos, sin = self.table[self.positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
            self._factors[dtype] = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return self._factors[dtype]


def apply_rotary(qk: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """qk [T, q_heads + kv_heads, d] (halves x1, x2): queries and keys rotated together.

    x1*cos - x2*sin | x2*cos + x1*sin, written as qk*(cos|cos) + (x2|x1)*(-sin|sin): the same
    roundings in four ops instead of seven."""
    cos, sin_signed = rotation.factors(qk.dtype)
    swapped = qk.roll(qk.shape[-1] // 2, dims=-1)
    return qk * cos + swapped * sin_signed
