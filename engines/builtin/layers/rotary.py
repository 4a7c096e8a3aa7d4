"""Rotary position embeddings (the non-interleaved "rotate half" layout of Hugging Face Llama),
with Llama-3.1, linear, dynamic NTK and YaRN frequency scaling."""

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
    if rope_type == "yarn":
        assert scaling is not None
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    return inv_freq


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as Hugging Face computes it: the frequencies that turn fewer
    than `beta_slow` times over the original context are interpolated (divided by `factor`),
    those turning more than `beta_fast` times kept, a linear ramp over the dimensions between."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dimension_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(fast), dimension_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device)
    kept = 1 - ((dims - low) / (high - low)).clamp(0, 1)  # each frequency's share kept as is
    wavelengths = theta ** (torch.arange(0, head_dim, 2, device=inv_freq.device).float() / head_dim)
    return 1.0 / (factor * wavelengths) * (1 - kept) + inv_freq * kept


def _dynamic_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], positions: torch.Tensor
) -> torch.Tensor:
    """Dynamic NTK scaling (Hugging Face's `dynamic`): past the original context a longer
    sequence raises the base, theta x (factor x length / original - (factor - 1)) ^ (d / (d -
    2)). Transformers recomputes it per forward from the longest position in it; a position's
    row here is what transformers uses when that position is the newest, so cached greedy
    generation from a prompt within the original context rotates as transformers does (a
    longer prompt, prefilled at once, takes per-position bases where transformers takes its
    whole length's). [positions] -> [positions, d / 2]."""
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    length = torch.clamp(positions + 1, min=original)
    base = theta * (factor * length / original - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
    return 1.0 / base[:, None] ** (exponents.float() / head_dim)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN scales cos and sin by (1 otherwise): `attention_factor`, else 0.1 ln(factor)
    + 1 (with `mscale` / `mscale_all_dim`: the ratio of two such terms)."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


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
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        if (scaling or {}).get("rope_type") == "dynamic":
            assert scaling is not None
            angles = positions[:, None] * _dynamic_inv_freq(head_dim, theta, scaling, positions)
        else:
            angles = torch.outer(positions, rope_inv_freq(head_dim, theta, scaling, device))
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        attention = rope_attention_factor(scaling)
        if attention != 1.0:  # YaRN scales cos and sin, so the attention logits by its square
            table = table * attention
        # cos|sin side by side so one gather per step serves both.
        self.register_buffer("cos_sin_table", table, persistent=False)

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
