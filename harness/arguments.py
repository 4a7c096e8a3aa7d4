"""argparse `type`s the lab's commands and scripts share: a bad value is argparse's one line
naming the option and what it allows, exit 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An integer >= `low`, e.g. `--steps 0` or `--steps abc`: '0' is invalid; allowed: an
    integer >= 1."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: an integer >= {low}")
        return value

    return integer


def integers_at_least(low: int) -> Callable[[str], list[int]]:
    """Comma-separated integers, each >= `low` (e.g. --batch-sizes 1,2)."""
    one = at_least(low)

    def integers(text: str) -> list[int]:
        try:
            return [one(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid; allowed: comma-separated integers >= {low}"
            ) from None

    return integers
