"""The gate on bad and empty inputs, through `inferlab gate` (harness.cli): nothing compared is
inconclusive (exit 2) whatever the input's shape; a damaged file is exit 2 naming it, never a
traceback and never exit 1 (which CI reads as a regression); required metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import SOURCE_ROOT, cli
from harness.gating import ab
from harness.gating import cli as gate

GOOD = {
    "num_steps": 40,
    "output_tokens_total": 320,
    "prefill_tokens_total": 768,
    "output_tok_per_s": 100.0,
    "tpot_p50_s": 0.01,
}
ABSENT = object()  # a summary.json without the `metrics` key


def write_run(
    path: Path,
    metrics: Any = None,
    status: Any = "complete",
    provenance: Any = ABSENT,
    **extra: Any,
) -> Path:
    """A run folder; `metrics` defaults to GOOD, ABSENT leaves the key out."""
    path.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"status": status, **extra}
    if metrics is not ABSENT:
        summary["metrics"] = dict(GOOD) if metrics is None else metrics
    (path / "summary.json").write_text(json.dumps(summary))
    if provenance is not ABSENT:
        (path / "provenance.json").write_text(json.dumps(provenance))
    return path


def write_rules(tmp_path: Path, rules: Any, name: str = "rules.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(rules))
    return path


def counters_only(tmp_path: Path) -> Path:
    """Rules that gate counters alone, so single runs can pass (timing needs repeats)."""
    return write_rules(tmp_path, {"metrics": {"timing": []}}, "counters.yaml")


def inferlab_gate(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = cli.main(["gate", *(str(a) for a in argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def sides(base: Path, cand: Path) -> list[str]:
    return ["--baseline", str(base), "--candidate", str(cand)]


# ---- nothing compared is inconclusive ------------------------------------------------------

EMPTY_METRICS = {
    "absent": ABSENT,
    "null": "null",
    "empty": {},
    "no registry metric": {"foo": 1.0, "bar": 2},
}


def write_empty_run(path: Path, variant: str) -> Path:
    metrics = EMPTY_METRICS[variant]
    if metrics == "null":
        path.mkdir(parents=True)
        (path / "summary.json").write_text(json.dumps({"status": "complete", "metrics": None}))
        return path
    return write_run(path, metrics)


@pytest.mark.parametrize("variant", list(EMPTY_METRICS))
@pytest.mark.parametrize("empty_side", ["baseline", "candidate", "both"])
def test_a_run_without_metrics_never_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], variant: str, empty_side: str
) -> None:
    rules = counters_only(tmp_path)
    good = write_run(tmp_path / "good")
    empty = write_empty_run(tmp_path / "empty", variant)
    other = write_empty_run(tmp_path / "other", variant) if empty_side == "both" else good
    base, cand = (empty, other) if empty_side != "candidate" else (good, empty)
    code, out, err = inferlab_gate(capsys, *sides(base, cand), "--rules", rules)
    assert code == 2, out + err  # today: PASS (exit 0) with every row "missing"
    assert "INCONCLUSIVE (exit 2)" in out
    assert re.search(
        r"\| `status` \| - \| - \| - \| - \| inconclusive: nothing compared: "
        r"none of the \d+ gated metrics has a value on both sides",
        out,
    )
    if empty_side != "both":
        assert f"the {empty_side} runs hold none of the gated metrics" in out
    assert f"{empty / 'summary.json'}: status complete but `metrics` is" in out
    # the same good runs on both sides do pass: the check above is about the empty side
    assert inferlab_gate(capsys, *sides(good, good), "--rules", rules)[0] == 0


def test_nothing_compared_in_repeats_and_folders_of_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = counters_only(tmp_path)
    for k in range(3):
        write_run(tmp_path / "base" / f"repeat-{k}")
        write_run(tmp_path / "cand" / f"repeat-{k}", metrics=ABSENT)
        write_run(tmp_path / "folder" / str(k), metrics={})
    code, out, _ = inferlab_gate(
        capsys, *sides(tmp_path / "base", tmp_path / "cand"), "--rules", rules
    )
    assert code == 2 and "nothing compared" in out
    code, out, _ = inferlab_gate(
        capsys, *sides(tmp_path / "folder", tmp_path / "base"), "--rules", rules
    )
    assert code == 2 and "the baseline runs hold none of the gated metrics" in out


def write_job(sweep: Path, num: int, overrides: list[str], metrics: Any = None) -> None:
    job = write_run(sweep / str(num), metrics)
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))


def test_a_sweep_job_with_nothing_compared_is_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = counters_only(tmp_path)
    for name in ("base", "ok"):
        write_job(tmp_path / name, 0, ["engine.kv_cache=none"])
        write_job(tmp_path / name, 1, ["engine.kv_cache=paged"])
    write_job(tmp_path / "cand", 0, ["engine.kv_cache=none"])
    write_job(tmp_path / "cand", 1, ["engine.kv_cache=paged"], metrics=ABSENT)
    code, out, _ = inferlab_gate(
        capsys, *sides(tmp_path / "base", tmp_path / "ok"), "--rules", rules
    )
    assert code == 0, out
    code, out, _ = inferlab_gate(
        capsys, *sides(tmp_path / "base", tmp_path / "cand"), "--rules", rules
    )
    assert code == 2, out  # today: PASS, the other job's counters being equal
    assert "| engine.kv_cache=paged | `status` |" in out and "nothing compared" in out
    assert "job engine.kv_cache=paged: the candidate runs hold none of the gated" in out


def write_ab(path: Path, rounds: int, metrics: Any = None) -> Path:
    entries = []
    for k in range(rounds):
        write_run(path / f"round-{k}-a", metrics)
        write_run(path / f"round-{k}-b", metrics)
        entries.append({"round": k, "a": f"round-{k}-a", "b": f"round-{k}-b"})
    (path / "ab.json").write_text(json.dumps({"version": 1, "rounds": entries}))
    return path


def test_an_ab_folder_without_metrics_is_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = counters_only(tmp_path)
    good = write_ab(tmp_path / "good", 3)
    empty = write_ab(tmp_path / "empty", 3, metrics=ABSENT)
    assert inferlab_gate(capsys, "--ab", good, "--rules", rules)[0] == 0
    code, out, _ = inferlab_gate(capsys, "--ab", empty, "--rules", rules)
    assert code == 2 and "neither side holds any" in out
    code, out, _ = inferlab_gate(capsys, *sides(good, empty), "--rules", rules)
    assert code == 2 and "nothing compared" in out  # today: PASS


# ---- a gated metric on one side only; required metrics -------------------------------------


def test_a_metric_on_one_side_is_a_warning_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = counters_only(tmp_path)
    base = write_run(tmp_path / "base", {**GOOD, "kv_utilization_mean": 0.5})
    cand = write_run(tmp_path / "cand")
    code, out, _ = inferlab_gate(capsys, *sides(base, cand), "--rules", rules)
    assert code == 0, out  # a warning only: e.g. a kv_cache=none run has no KV utilization
    assert (
        "- warning: gated metric(s) absent in the candidate, present in the baseline: "
        "kv_utilization_mean"
    ) in out
    code, out, _ = inferlab_gate(capsys, *sides(cand, base), "--rules", rules)
    assert "gated metric(s) absent in the baseline, present in the candidate" in out


def test_require_metric_makes_a_missing_metric_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = counters_only(tmp_path)
    base = write_run(tmp_path / "base", {**GOOD, "kv_utilization_mean": 0.5})
    cand = write_run(tmp_path / "cand")
    both = write_run(tmp_path / "both", {**GOOD, "kv_utilization_mean": 0.5})
    args = ["--rules", str(rules), "--require-metric", "kv_utilization_mean"]
    code, out, _ = inferlab_gate(capsys, *sides(base, cand), *args)
    assert code == 2, out
    assert (
        "| `kv_utilization_mean` (fraction) | 0.5 | - | - | - | MISSING (required): absent "
        f"in 1 of 1 candidate run(s), e.g. {cand / 'summary.json'} |"
    ) in out
    assert inferlab_gate(capsys, *sides(base, both), *args)[0] == 0
    # absent on both sides: no row at all without the requirement, an inconclusive one with it
    code, out, _ = inferlab_gate(capsys, *sides(cand, cand), *args)
    assert code == 2 and "MISSING (required): absent in 1 of 1 baseline run(s)" in out
    # the rules key does the same
    required = write_rules(
        tmp_path, {"metrics": {"timing": [], "require": ["kv_utilization_mean"]}}
    )
    assert inferlab_gate(capsys, *sides(base, cand), "--rules", required)[0] == 2
    assert inferlab_gate(capsys, *sides(base, both), "--rules", required)[0] == 0


def test_a_required_metric_absent_in_one_repeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k in range(3):
        write_run(tmp_path / "base" / f"repeat-{k}")
        write_run(
            tmp_path / "cand" / f"repeat-{k}",
            {k: v for k, v in GOOD.items() if k != "num_steps"} if k == 2 else None,
        )
    args = [*sides(tmp_path / "base", tmp_path / "cand"), "--rules", str(counters_only(tmp_path))]
    assert inferlab_gate(capsys, *args)[0] == 0  # compared on the runs that have it
    code, out, _ = inferlab_gate(capsys, *args, "--require-metric", "num_steps")
    assert code == 2 and "absent in 1 of 3 candidate run(s)" in out


def test_a_regression_stands_beside_a_missing_required_metric(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = write_run(tmp_path / "base", {**GOOD, "kv_utilization_mean": 0.5})
    cand = write_run(tmp_path / "cand", {**GOOD, "prefill_tokens_total": 900})
    code, out, _ = inferlab_gate(
        capsys,
        *sides(base, cand),
        "--rules",
        counters_only(tmp_path),
        "--require-metric",
        "kv_utilization_mean",
    )
    assert code == 1 and "MISSING (required)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--require-metric", "tok_per_sec"], "--require-metric: unknown metric 'tok_per_sec'"),
        (
            ["--require-metric", "ttft_p50_s"],
            "--require-metric: 'ttft_p50_s' does not gate under these rules; add it to "
            "rules.metrics.timing",
        ),
    ],
)
def test_bad_require_metric_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    run = write_run(tmp_path / "run")
    code, out, err = inferlab_gate(capsys, *sides(run, run), *argv)
    assert code == 2 and message in err and not out


@pytest.mark.parametrize(
    "rules, message",
    [
        ({"metrics": {"require": "num_steps"}}, "rules.metrics.require: expected a list"),
        ({"metrics": {"require": ["nope"]}}, "rules.metrics.require: unknown metric 'nope'"),
        (
            {"metrics": {"require": ["num_steps"], "exclude": ["num_steps"]}},
            "rules.metrics.require: 'num_steps' does not gate",
        ),
        ({"metrics": {"timing": [], "deterministic": []}}, "rules.metrics: no metric gates"),
        (
            {"metrics": {"timing": ["tpot_p50_s"], "deterministic": [], "exclude": ["tpot_p50_s"]}},
            "rules.metrics: no metric gates",
        ),
        (
            {"deterministic": {"rel_tol": float("inf")}},
            "rules.deterministic.rel_tol: inf is invalid",
        ),
        (
            {"timing": {"resamples": 10**11}},
            "rules.timing.resamples: 100000000000 is invalid; "
            "allowed: an integer in [100, 1000000]",
        ),
    ],
)
def test_bad_rules_are_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rules: Any, message: str
) -> None:
    run = write_run(tmp_path / "run")
    code, out, err = inferlab_gate(
        capsys, *sides(run, run), "--rules", write_rules(tmp_path, rules)
    )
    assert code == 2 and message in err and not out


def test_a_rules_file_that_is_not_utf8_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "run")
    rules = tmp_path / "rules.yaml"
    rules.write_bytes(b"timing: {seed: \xff}\n")
    code, _, err = inferlab_gate(capsys, *sides(run, run), "--rules", rules)
    assert code == 2 and f"--rules: {rules} is not UTF-8 text" in err


def test_gate_ab_refuses_an_unknown_required_metric_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = inferlab_gate(
        capsys,
        "ab",
        "--baseline",
        "",
        "--candidate",
        "",
        "--out",
        tmp_path / "ab",
        "--require-metric",
        "nope",
    )
    assert code == 2 and "--require-metric: unknown metric 'nope'" in err
    assert not (tmp_path / "ab").exists()


# ---- damaged files: exit 2 naming the file, never a traceback ------------------------------

RAW_SUMMARIES = {
    "a list": (b"[1, 2]", "expected a JSON object, got a list"),
    "a string": (b'"complete"', "expected a JSON object, got a string"),
    "a number": (b"42", "expected a JSON object, got a number"),
    "null": (b"null", "expected a JSON object, got null"),
    "truncated": (b'{"status": "complete", "metr', "not valid JSON"),
    "empty": (b"", "empty file"),
    "invalid UTF-8": (b'{"status": "\xff\xfe"}', "not UTF-8 text"),
    "metrics a list": (
        b'{"status": "complete", "metrics": [1, 2]}',
        "`metrics` must be an object of metric names to numbers, got a list",
    ),
    "metrics a string": (
        b'{"status": "complete", "metrics": "fast"}',
        "`metrics` must be an object",
    ),
    "a string value": (
        b'{"status": "complete", "metrics": {"num_steps": "40"}}',
        "metrics.num_steps: '40' is not a number",
    ),
    "a boolean value": (
        b'{"status": "complete", "metrics": {"num_steps": true}}',
        "metrics.num_steps: true is not a number",
    ),
    "a list value": (
        b'{"status": "complete", "metrics": {"output_tok_per_s": [1]}}',
        "metrics.output_tok_per_s: [1] is not a number",
    ),
    "status a list": (b'{"status": ["complete"], "metrics": {}}', "`status` must be a string"),
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
    "a 400-digit integer": (
        b'{"status": "complete", "metrics": {"num_steps": ' + b"9" * 400 + b"}}",
        "metrics.num_steps: an integer of 400 digits is out of range",
    ),
}


@pytest.mark.parametrize("name", list(RAW_SUMMARIES))
@pytest.mark.parametrize("where", ["candidate", "baseline repeat"])
def test_a_damaged_summary_is_exit_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, where: str
) -> None:
    raw, message = RAW_SUMMARIES[name]
    good = write_run(tmp_path / "good")
    if where == "candidate":
        bad = tmp_path / "bad"
        bad.mkdir()
        base, cand = good, bad
    else:
        write_run(tmp_path / "reps" / "repeat-0")
        bad = tmp_path / "reps" / "repeat-1"
        bad.mkdir()
        base, cand = tmp_path / "reps", good
    (bad / "summary.json").write_bytes(raw)
    code, out, err = inferlab_gate(capsys, *sides(base, cand))
    assert code == 2, out + err  # today: a traceback (exit 1) for several of these
    assert f"inferlab gate: error: {bad / 'summary.json'}: {message}" in err
    assert "Traceback" not in err and not out


def test_a_summary_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_run(tmp_path / "good")
    (tmp_path / "bad" / "summary.json").mkdir(parents=True)
    code, _, err = inferlab_gate(capsys, *sides(good, tmp_path / "bad"))
    assert code == 2 and f"{tmp_path / 'bad' / 'summary.json'}: is a folder, not a file" in err


def test_a_summary_over_the_limit_or_not_a_regular_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run folder's JSON and YAML are read whole: a summary.json of gigabytes was read into
    memory; a summary.json that links to a device was reported as 'no such file'."""
    good = write_run(tmp_path / "good")
    big = write_run(tmp_path / "big")
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "64")
    code, _, err = inferlab_gate(capsys, *sides(good, big))
    assert code == 2
    assert err.startswith(f"inferlab gate: error: {good / 'summary.json'}: ")
    assert "bytes is more than the 64 bytes allowed for a settings file; to read it, raise " in err
    monkeypatch.delenv("INFERLAB_MAX_INPUT_BYTES")
    (big / "summary.json").unlink()
    (big / "summary.json").symlink_to("/dev/zero")
    code, _, err = inferlab_gate(capsys, *sides(good, big))
    assert code == 2
    assert err == (
        f"inferlab gate: error: {big / 'summary.json'}: is a character device, not a regular file\n"
    )


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("metric", ["num_steps", "output_tok_per_s"])
def test_non_finite_metric_values_are_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: float, metric: str
) -> None:
    for k in range(5):  # enough runs that timing could be decided
        write_run(tmp_path / "base" / f"repeat-{k}")
        write_run(tmp_path / "cand" / f"repeat-{k}", {**GOOD, metric: value} if k == 3 else None)
    code, out, err = inferlab_gate(capsys, *sides(tmp_path / "base", tmp_path / "cand"))
    assert code == 2, out + err  # today: nan counters read as "improved"; nan timing, an error
    bad = tmp_path / "cand" / "repeat-3"
    assert f"inconclusive: not a finite number ({value}) in candidate run {bad} |" in out


def test_negative_timing_values_are_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k in range(5):
        write_run(tmp_path / "base" / f"repeat-{k}")
        write_run(tmp_path / "cand" / f"repeat-{k}", {**GOOD, "output_tok_per_s": -100.0})
    code, out, _ = inferlab_gate(capsys, *sides(tmp_path / "base", tmp_path / "cand"))
    assert code == 2 and "non-positive values: no ratio" in out


@pytest.mark.parametrize(
    "text, message",
    [
        ("[engine.kv_cache=none", "not valid YAML"),
        ("engine.kv_cache: none", "expected a list of override strings"),
        ("engine.kv_cache=none", "expected a list of override strings"),
        ("- [1, 2]", "expected a list of override strings"),
    ],
)
def test_damaged_sweep_overrides_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    write_job(tmp_path / "base", 0, ["engine.kv_cache=none"])
    write_job(tmp_path / "cand", 0, ["engine.kv_cache=none"])
    overrides = tmp_path / "cand" / "0" / ".hydra" / "overrides.yaml"
    overrides.write_text(text)
    code, out, err = inferlab_gate(capsys, *sides(tmp_path / "base", tmp_path / "cand"))
    assert code == 2 and f"{overrides}: {message}" in err and not out


@pytest.mark.parametrize(
    "content, message",
    [
        (b"[1]", "ab.json: expected a JSON object, got a list"),
        (b'{"rounds": [', "ab.json: not valid JSON"),
        (b'{"rounds": "x"}', "ab.json: `rounds` must be a list of rounds"),
        (b'{"rounds": [1]}', "ab.json: rounds[0] must be an object with `a` and `b`"),
        (b'{"rounds": [{"a": 1, "b": "round-0-b"}]}', "ab.json: rounds[0].a: 1 is invalid"),
        (
            b'{"rounds": [{"a": "../elsewhere", "b": "round-0-b"}]}',
            "ab.json: rounds[0].a: '../elsewhere' is invalid",
        ),
        (
            b'{"rounds": [{"a": "round-0-a", "b": "/tmp/x"}]}',
            "ab.json: rounds[0].b: '/tmp/x' is invalid",
        ),
    ],
)
@pytest.mark.parametrize("mode", ["--ab", "--candidate"])
def test_a_damaged_ab_json_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str, mode: str
) -> None:
    folder = write_ab(tmp_path / "ab", 1)
    (folder / "ab.json").write_bytes(content)
    argv = ["--ab", folder] if mode == "--ab" else sides(write_run(tmp_path / "run"), folder)
    code, out, err = inferlab_gate(capsys, *argv)
    assert code == 2 and f"inferlab gate: error: {folder}/{message}" in err
    assert "Traceback" not in err and not out


@pytest.mark.parametrize(
    "name, content",
    [
        ("config.yaml", "engine: [contiguous"),
        ("config.yaml", "- 1\n- 2\n"),
        ("provenance.json", "[1]"),
        ("provenance.json", '{"hostname_hash": "h", "cpu": '),
    ],
)
def test_a_damaged_optional_file_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str
) -> None:
    base = write_run(tmp_path / "base")
    cand = write_run(tmp_path / "cand")
    (cand / name).write_text(content)
    code, out, err = inferlab_gate(capsys, *sides(base, cand), "--rules", counters_only(tmp_path))
    assert code == 0, out + err  # today: a traceback (exit 1)
    assert f"- warning: candidate run: {cand / name}:" in out and "not used" in out


def test_odd_provenance_fields_do_not_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = write_run(tmp_path / "base", provenance={"hostname_hash": "h", "cpu": {}})
    cand = write_run(tmp_path / "cand", provenance={"hostname_hash": ["h"], "cpu": "x86", "gpu": 3})
    code, out, _ = inferlab_gate(capsys, *sides(base, cand), "--rules", counters_only(tmp_path))
    assert code == 0 and "ran on different machines" in out  # today: AttributeError, exit 1


def test_unknown_machines_void_timing_under_the_strict_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    machine = {"hostname_hash": "h", "cpu": {"model": "cpu", "logical_cpus": 2}}
    for k in range(6):
        write_run(tmp_path / "base" / f"repeat-{k}", provenance=machine)
        write_run(tmp_path / "cand" / f"repeat-{k}")  # no provenance.json
    args = sides(tmp_path / "base", tmp_path / "cand")
    assert inferlab_gate(capsys, *args)[0] == 0  # the default rule: a warning at most
    strict = write_rules(tmp_path, {"different_machine": "inconclusive"})
    code, out, _ = inferlab_gate(capsys, *args, "--rules", strict)
    assert code == 2, out  # today: PASS although the machines could not be compared
    assert "6 run(s) have no readable provenance.json" in out
    assert "machine unknown (rules.different_machine: inconclusive)" in out


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_an_unwritable_output_file_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    run = write_run(tmp_path / "run")
    code, out, err = inferlab_gate(
        capsys, *sides(run, run), "--rules", counters_only(tmp_path), flag, tmp_path / "no" / "x"
    )
    where = f"{flag}: {tmp_path / 'no' / 'x'}: cannot be written: No such file or directory"
    assert code == 2 and where in err
    assert not out  # no table saying "PASS (exit 0)" before the failure


@pytest.mark.parametrize("argv", [["--baseline", "nowhere"], ["--ab", "nowhere"]])
def test_missing_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    run = write_run(tmp_path / "run")
    argv = [argv[0], str(tmp_path / argv[1])]
    if argv[0] == "--baseline":
        argv += ["--candidate", str(run)]
    code, _, err = inferlab_gate(capsys, *argv)
    assert code == 2 and str(tmp_path / "nowhere") in err


def test_a_bug_is_exit_2_not_a_regression(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("oops")

    monkeypatch.setattr(gate, "compare_sides", broken)
    run = write_run(tmp_path / "run")
    code, out, err = inferlab_gate(capsys, *sides(run, run))
    assert code == 2 and "internal error" in err and "KeyError: 'oops'" in err and not out


def test_the_command_line_exits_2_on_a_damaged_summary(tmp_path: Path) -> None:
    """The installed entry point, as CI calls it: exit status 2, one line, no traceback."""
    good = write_run(tmp_path / "good")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text("[]")
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "gate", *sides(good, bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"inferlab gate: error: {bad / 'summary.json'}: expected a JSON object, got a list ([])"
    ]


# ---- A/B mode's own readers ----------------------------------------------------------------


def test_ab_worker_garbage_reply_is_a_failed_run(tmp_path: Path) -> None:
    worker = ab.Worker("a", tmp_path / "worker-a.log", SOURCE_ROOT)
    worker.process = subprocess.Popen(
        [sys.executable, "-c", "print('hello')"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    reply = worker._read()  # today: JSONDecodeError out of the A/B job
    worker.close()
    assert reply["status"] == "failed" and "replied 'hello\\n', not a JSON object" in reply["error"]


@pytest.mark.parametrize("layout", ["harness/running/experiment.py", "harness/experiment.py"])
def test_ab_worker_runs_a_checkout_of_either_harness_layout(tmp_path: Path, layout: str) -> None:
    """A base from before the harness sub-packages (harness/experiment.py) can be gated against;
    the worker must import the run from that checkout alone, never fill a module the checkout
    lacks from the installed inferlab."""
    code = tmp_path / "checkout"
    module = code / layout
    for folder in [module.parent, *module.parent.parents]:
        if folder == code:
            break
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    module.write_text(
        "def run_experiment(config, run_dir, progress):\n"
        f"    return {{'status': 'complete', 'error': {layout!r}}}\n"
    )
    worker = ab.Worker("a", tmp_path / "worker-a.log", code)
    worker.start()
    worker.wait_ready()
    reply = worker.run({}, tmp_path / "run")
    worker.close()
    assert reply["status"] == "complete" and reply["error"] == layout


def test_paired_ratios_skip_damaged_and_non_finite_values(tmp_path: Path) -> None:
    a = write_run(
        tmp_path / "a", {"output_tok_per_s": 100.0, "tpot_p50_s": 0.01, "ttft_p50_s": float("inf")}
    )
    b = write_run(
        tmp_path / "b", {"output_tok_per_s": 90.0, "tpot_p50_s": 0.011, "ttft_p50_s": 0.5}
    )
    ratios = ab.paired_ratios(a, b)
    assert ratios == pytest.approx({"output_tok_per_s": 0.9, "tpot_p50_s": 1.1})
    (b / "summary.json").write_text("[1]")
    assert ab.paired_ratios(a, b) == {}  # today: AttributeError out of the A/B job


def test_a_huge_configuration_value_is_shown_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A configuration difference names the key and a bounded picture of the values: an
    imported run's config.yaml may hold whatever the tool's file held (a YAML alias bomb
    expands to hundreds of megabytes when printed whole)."""
    rules = counters_only(tmp_path)
    base, cand = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    leaf = ["lol"] * 9
    for _ in range(7):  # 9**8 strings when expanded
        leaf = [leaf] * 9
    (base / "config.yaml").write_text(yaml.safe_dump({"source": {"bomb": leaf}}))
    (cand / "config.yaml").write_text(yaml.safe_dump({"source": {"bomb": None}}))
    code, out, _ = inferlab_gate(capsys, *sides(base, cand), "--rules", rules)
    assert code == 0, out
    [line] = [line for line in out.splitlines() if "configuration differs" in line]
    assert "source.bomb: [[[...]" in line and line.endswith("-> None")
    assert len(line) < 300
