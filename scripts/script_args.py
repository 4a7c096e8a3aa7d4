"""What the scripts' command lines share (imported by the scripts, not run)."""

from __future__ import annotations

import argparse
import sys
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
