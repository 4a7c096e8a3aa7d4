"""What the scripts' command lines share (imported by the scripts, not run)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.run_folder import output_file_path


def parse_args_checking_out(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed arguments, with `--out` (if given) checked before the script measures
    anything: an empty path, a folder or a run folder's own file ends in one line, exit 2."""
    args = parser.parse_args()
    if args.out is not None:
        try:
            args.out = output_file_path(args.out, "--out")
        except ValueError as exc:
            parser.error(str(exc))
    return args


def refuse(message: str) -> NoReturn:
    """A bad argument or configuration: one line, exit 2. A check's exit 1 means its target was
    missed (`make check-*`), so a typo must never end in 1 (nor in a traceback)."""
    print(f"{Path(sys.argv[0]).name}: {message}", file=sys.stderr)
    raise SystemExit(2)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse `type`: an integer >= `low`, else argparse's one line naming the option,
    exit 2."""

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
    """An argparse `type`: comma-separated integers, each >= `low` (e.g. --batch-sizes 1,2)."""
    one = at_least(low)

    def integers(text: str) -> list[int]:
        try:
            return [one(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid; allowed: comma-separated integers >= {low}"
            ) from None

    return integers
