"""What the scripts' command lines share (imported by the scripts, not run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
