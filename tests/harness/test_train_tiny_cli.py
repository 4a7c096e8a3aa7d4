"""`inferlab train-tiny`'s plain mistakes are one line and exit 2, before any training: a
--seed neither torch nor numpy takes, and a --text too short to train on, were tracebacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import cli


@pytest.mark.parametrize("seed", ["-1", "18446744073709551616", "99999999999999999999999"])
def test_a_seed_out_of_range_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seed: str
) -> None:
    """--seed -1 was numpy's 'ValueError: expected non-negative integer' and 10**23 torch's
    'Overflow when unpacking long long', each a traceback, exit 1."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["train-tiny", "--steps", "1", "--seed", seed, "--out", str(tmp_path / "m")])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"inferlab train-tiny: error: argument --seed: '{seed}' is invalid; allowed: an "
        "integer in [0, 2**64 - 1]"
    )
    assert not (tmp_path / "m").exists()


def test_a_text_too_short_to_train_on_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty --text was 'ValueError: train-tiny: the text has 1 tokens; need > 129', a
    traceback, exit 1."""
    text = tmp_path / "empty.txt"
    text.write_text("\n")
    out = tmp_path / "m"
    assert cli.main(["train-tiny", "--steps", "1", "--text", str(text), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"inferlab train-tiny: --text: {text}: 1 tokens; allowed: a text of more than 129 "
        "tokens (one training window)\n"
    )


@pytest.mark.parametrize("steps", ["abc", "0", "1.5"])
def test_steps_that_are_not_a_positive_integer_are_refused_with_what_is_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: str
) -> None:
    """--steps abc was "argument --steps: invalid _positive value: 'abc'" (a function's name,
    nothing of what is allowed)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["train-tiny", "--steps", steps, "--out", str(tmp_path / "m")])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"inferlab train-tiny: error: argument --steps: '{steps}' is invalid; allowed: an "
        "integer >= 1"
    )
