"""The gate's absolute checks (rules.checks) and its comparison of capacity searches
(search.json's max_rate_at_slo and bracket), on hand-made run and sweep folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.gating import cli as gate
from harness.gating.rules import RulesError, load_rules


def make_run(path: Path, **metrics: Any) -> Path:
    path.mkdir(parents=True)
    base = {"num_steps": 40, "output_tokens_total": 320, "output_tok_per_s": 100.0}
    summary = {"status": "complete", "metrics": {**base, **metrics}}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def rules_file(tmp_path: Path, rules: Any) -> Path:
    """Rules that gate counters only: one run per side leaves any timing inconclusive."""
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"metrics": {"timing": []}, **rules}))
    return path


def run_gate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = gate.main(list(argv))
    return code, capsys.readouterr().out


def gate_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], checks: Any, **candidate: Any
) -> tuple[int, str, dict[str, Any]]:
    make_run(tmp_path / "base", slo_attainment=1.0, ttft_p99_s=1.0)
    make_run(tmp_path / "cand", **candidate)
    code, out, all_rows = gate_sweeps(tmp_path, capsys, {"checks": checks})
    rows = [r for r in all_rows if r["kind"] == "check"]
    return code, out, {r["note"].split(":")[0].removeprefix("check "): r for r in rows}


def test_checks_that_hold_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, rows = gate_runs(
        tmp_path,
        capsys,
        ["slo_attainment >= 0.99", "ttft_p99_s <= 2"],
        slo_attainment=0.995,
        ttft_p99_s=1.5,
    )
    assert code == 0
    assert {name: r["verdict"] for name, r in rows.items()} == {
        "slo_attainment >= 0.99": "pass",
        "ttft_p99_s <= 2": "pass",
    }
    assert rows["ttft_p99_s <= 2"]["candidate"] == 1.5


def test_a_failed_check_is_a_regression_naming_the_check_and_the_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, rows = gate_runs(
        tmp_path,
        capsys,
        ["slo_attainment >= 0.99", "ttft_p99_s <= 2"],
        slo_attainment=0.95,
        ttft_p99_s=1.5,
    )
    assert code == 1
    failed = next(r for r in rows.values() if r["verdict"] == "regression")
    assert failed["metric"] == "slo_attainment"
    assert failed["note"].startswith("check slo_attainment >= 0.99 failed: 0.95 in ")
    assert "REGRESSION: check slo_attainment >= 0.99 failed: 0.95" in out


def test_a_metric_missing_in_a_candidate_run_is_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, rows = gate_runs(tmp_path, capsys, ["slo_attainment >= 0.99"], ttft_p99_s=1.0)
    assert code == 2
    row = rows["slo_attainment >= 0.99"]
    assert row["verdict"] == "inconclusive" and "absent in 1 of 1 candidate run(s)" in row["note"]


def test_checks_apply_to_every_complete_candidate_repeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(tmp_path / "base", ttft_p99_s=1.0)
    for k, ttft in enumerate([1.0, 2.5, 1.2]):
        make_run(tmp_path / "cand" / f"repeat-{k}", ttft_p99_s=ttft)
    code, out = run_gate(
        capsys,
        "--baseline",
        str(tmp_path / "base"),
        "--candidate",
        str(tmp_path / "cand"),
        "--rules",
        str(rules_file(tmp_path, {"checks": {"ttft_p99_s": 2}})),
    )
    assert code == 1
    assert "check ttft_p99_s <= 2 failed: 2.5 in " in out and "repeat-1" in out


@pytest.mark.parametrize(
    ("checks", "message"),
    [
        (["ttft_p99_s <= 2", "ttft_p99 <= 1"], r"^rules\.checks\[1\]: 'ttft_p99' is not a metric"),
        (
            ["ttft_p99_s == 2"],
            r"^rules\.checks\[0\]: 'ttft_p99_s == 2' is invalid; allowed: "
            r"'METRIC OP BOUND' with OP one of \['<=', '<', '>=', '>'\]",
        ),
        ("slo_attainment >= x", r"^rules\.checks: bound 'x' is invalid; allowed: a finite number$"),
        (42, r"^rules\.checks: 42 is invalid; allowed: a list of 'METRIC OP BOUND' strings"),
        # every candidate failed one of the two: a regression whatever it measured
        (
            ["ttft_p99_s <= 1", "ttft_p99_s >= 2"],
            r"^rules\.checks: contradictory: ttft_p99_s <= 1 and ttft_p99_s >= 2 cannot both",
        ),
        ({"ttft_p99_s": True}, r"^rules\.checks\.ttft_p99_s: bound True is invalid"),
    ],
)
def test_bad_checks_name_the_key_and_what_is_allowed(
    tmp_path: Path, checks: Any, message: str
) -> None:
    with pytest.raises(RulesError, match=message):
        load_rules(rules_file(tmp_path, {"checks": checks}))


def test_the_default_rules_check_nothing() -> None:
    rules = load_rules()
    assert rules.checks == () and rules.to_dict()["checks"] == []


# capacity searches -----------------------------------------------------------------------------
def make_search_sweep(
    root: Path,
    outcome: str,
    answer: float | None,
    meets: float | None,
    misses: float | None,
    slo: list[str] | None = None,
) -> Path:
    """A sweep folder holding a search's jobs (one per load measured) and its search.json."""
    loads = [x for x in (meets, misses) if x is not None]
    for k, load in enumerate(loads):
        job = make_run(root / str(k), ttft_p99_s=1.0)
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(
            yaml.safe_dump([f"workload.arrival.rate={load}"])
        )

    def point(load: float | None) -> dict[str, Any] | None:
        return None if load is None else {"job": loads.index(load), "load": load}

    search = {
        "over": "rate",
        "slo": slo or ["ttft_p99_s <= 2"],
        "outcome": outcome,
        "max_rate_at_slo": answer,
        "bracket": {"meets": point(meets), "misses": point(misses)},
        "points": [],
        "num_points": len(loads),
        "note": "",
    }
    (root / "search.json").write_text(json.dumps(search))
    return root


def gate_searches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: tuple, cand: tuple
) -> tuple[int, dict[str, Any]]:
    make_search_sweep(tmp_path / "base", *base)
    make_search_sweep(tmp_path / "cand", *cand)
    code, _, rows = gate_sweeps(tmp_path, capsys)
    return code, next(r for r in rows if r["kind"] == "capacity")


def gate_sweeps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rules: dict[str, Any] | None = None
) -> tuple[int, str, list[dict[str, Any]]]:
    """The gate of tmp_path/cand against tmp_path/base under `rules` (over the defaults): its
    exit code, its output and its rows."""
    out_json = tmp_path / "gate.json"
    code, out = run_gate(
        capsys,
        "--baseline",
        str(tmp_path / "base"),
        "--candidate",
        str(tmp_path / "cand"),
        "--rules",
        str(rules_file(tmp_path, rules or {})),
        "--json",
        str(out_json),
    )
    return code, out, json.loads(out_json.read_text())["rows"]


def test_a_lower_capacity_beyond_the_brackets_is_a_regression(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the baseline met the SLO at 8 req/s; the candidate already missed it at 6
    code, row = gate_searches(tmp_path, capsys, ("found", 8.0, 8.0, 9.0), ("found", 5.0, 5.0, 6.0))
    assert code == 1
    assert row["metric"] == "max_rate_at_slo" and row["verdict"] == "regression"
    assert (row["baseline"], row["candidate"]) == (8.0, 5.0)
    assert "missed its SLO at 6, below 8" in row["note"]


def test_a_lower_capacity_within_the_resolution_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 7.5 < 8, but the candidate's bracket [7.5, 8.5) overlaps the baseline's [8, 9)
    code, row = gate_searches(tmp_path, capsys, ("found", 8.0, 8.0, 9.0), ("found", 7.5, 7.5, 8.5))
    assert code == 0
    assert row["verdict"] == "pass" and "the brackets overlap" in row["note"]


def test_a_higher_capacity_beyond_the_brackets_is_an_improvement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, row = gate_searches(
        tmp_path, capsys, ("found", 4.0, 4.0, 5.0), ("above_range", 16.0, 16.0, None)
    )
    assert code == 0 and row["verdict"] == "improved"


def test_a_candidate_that_meets_the_slo_nowhere_regresses_below_the_baselines_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, row = gate_searches(
        tmp_path, capsys, ("found", 4.0, 4.0, 5.0), ("below_range", None, None, 1.0)
    )
    assert code == 1 and row["verdict"] == "regression" and row["candidate"] is None


@pytest.mark.parametrize(
    ("cand", "why"),
    [
        (("failed", None, None, 1.0), "the candidate's search failed"),
        (("found", 4.0, 4.0, 5.0, ["ttft_p99_s <= 1"]), "the searches' SLOs differ"),
    ],
)
def test_searches_that_cannot_be_compared_are_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cand: tuple, why: str
) -> None:
    code, row = gate_searches(tmp_path, capsys, ("found", 4.0, 4.0, 5.0), cand)
    assert code == 2 and row["verdict"] == "inconclusive" and why in row["note"]


def test_a_grid_of_searches_is_compared_point_by_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep that searched per grid point (`{"searches": [...]}`): one capacity row per
    point, matched by its grid overrides; a point only one side searched is missing."""
    for side, answers in (("base", {4: 8.0, 16: 12.0}), ("cand", {4: 5.0, 16: 12.0, 32: 3.0})):
        root = make_search_sweep(tmp_path / side, "found", 8.0, 8.0, 9.0)
        records = [
            {
                **json.loads((root / "search.json").read_text()),
                "grid": {"engine.max_num_seqs": seqs},
                "max_rate_at_slo": rate,
                "bracket": {
                    "meets": {"job": 0, "load": rate},
                    "misses": {"job": 1, "load": rate + 1},
                },
            }
            for seqs, rate in answers.items()
        ]
        (root / "search.json").write_text(json.dumps({"searches": records}))
    code, _, all_rows = gate_sweeps(tmp_path, capsys)
    rows = {r["job"]: r for r in all_rows if r["kind"] == "capacity"}
    assert code == 1
    assert rows["engine.max_num_seqs=4"]["verdict"] == "regression"  # misses at 6 < meets at 8
    assert rows["engine.max_num_seqs=16"]["verdict"] == "pass"
    assert rows["engine.max_num_seqs=32"]["verdict"] == "missing"


@pytest.mark.parametrize("num_points", ["Infinity", "NaN", "-3"])
def test_a_damaged_num_points_is_no_internal_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], num_points: str
) -> None:
    """num_points: Infinity (Python's json reads it) made int() raise OverflowError, a gate
    internal error; NaN a one-line ValueError naming neither file nor key. A count that is
    no finite number >= 0 now reads as 0 and the row is decided on the brackets."""
    make_search_sweep(tmp_path / "cand", "found", 6.0, 6.0, 7.0)
    path = tmp_path / "cand" / "search.json"
    path.write_text(path.read_text().replace('"num_points": 2', f'"num_points": {num_points}'))
    make_search_sweep(tmp_path / "base", "found", 6.0, 6.0, 7.0)
    out_json = tmp_path / "gate.json"
    run_gate(
        capsys, "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand"),
        "--rules", str(rules_file(tmp_path, {})), "--json", str(out_json),
    )  # fmt: skip
    row = next(r for r in json.loads(out_json.read_text())["rows"] if r["kind"] == "capacity")
    assert row["verdict"] == "pass" and row["n_candidate"] == 0 and row["n_baseline"] == 2


def test_a_check_on_a_search_answer_is_refused(tmp_path: Path) -> None:
    """max_rate_at_slo is in search.json, never in a run: as a check every run would be
    'absent' and the gate inconclusive for ever."""
    with pytest.raises(RulesError, match=r"rules\.checks\[0\]: max_rate_at_slo >= 3 is invalid"):
        load_rules(rules_file(tmp_path, {"checks": ["max_rate_at_slo >= 3"]}))
