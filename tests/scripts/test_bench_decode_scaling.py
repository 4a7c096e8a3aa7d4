"""scripts/bench_decode_scaling.py's arguments (hostile pass, issue 36): what it refuses before
it measures anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_decode_scaling.py"


def refusal(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("option", ["cpu_wait_policy=auto", "cpu_wait_policy=passive"])
def test_an_engine_option_policy_beside_a_variants_policy_is_refused(option: str) -> None:
    """--engine-option applies after a variant's @policy: the rows labelled @passive and
    @active both measured `auto` (this option's value) before."""
    line = refusal(
        "--variants",
        "int4_g32_fp32@passive,int4_g32_fp32@active",
        "--engine-option",
        option,
    )
    assert "cpu_wait_policy: set by --variants' @policy on int4_g32_fp32@passive," in line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--variants", "llamacpp@passive"], "allowed after @: a built-in variant's"),
        (["--variants", "foo@auto"], "--variants: unknown ['foo@auto']"),
        (["--busy-core", "99"], "--busy-core: 99 is not a CPU this process may run on"),
    ],
)
def test_bad_flags_are_refused_with_the_reason(args: list[str], said: str) -> None:
    assert said in refusal(*args)
