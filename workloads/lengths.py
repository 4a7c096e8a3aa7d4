"""Length specifications: a fixed integer or an inclusive [low, high] range, sampled seeded."""

from __future__ import annotations

from typing import Any

import numpy as np


def parse_length(field: str, value: Any) -> tuple[int, int]:
    """`128` -> (128, 128); `[64, 192]` -> (64, 192). Errors name the field."""
    if isinstance(value, bool):
        raise ValueError(f"workload.{field}: {value!r} is invalid; allowed: an integer >= 1 "
                         "or a range [low, high]")
    if isinstance(value, int):
        low = high = value
    elif isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        low, high = value
    else:
        raise ValueError(f"workload.{field}: {value!r} is invalid; allowed: an integer >= 1 "
                         "or a range [low, high]")
    if low < 1 or high < low:
        raise ValueError(f"workload.{field}: {value!r} is invalid; need 1 <= low <= high")
    return low, high


def sample_lengths(bounds: tuple[int, int], n: int, rng: np.random.Generator) -> list[int]:
    low, high = bounds
    if low == high:
        return [low] * n
    return rng.integers(low, high + 1, size=n).tolist()
