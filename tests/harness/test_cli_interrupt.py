"""Ctrl-C while a command starts (importing torch takes seconds) ended `inferlab serve`,
`run` or `kv-calc` in a KeyboardInterrupt traceback from inside an import; it is now one line,
`inferlab: interrupted`, and exit 130 (128 + SIGINT), as a command interrupted later ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# the command's module is imported, and Ctrl-C arrives inside it (no wall-clock race)
SCRIPT = """
import harness.measuring.kv_calc as kv_calc

def interrupted(args):
    raise KeyboardInterrupt

kv_calc.main = interrupted
from harness.cli import main
raise SystemExit(main(["kv-calc", "model=tiny"]))
"""


def test_ctrl_c_while_a_command_starts_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "inferlab: interrupted\n"
