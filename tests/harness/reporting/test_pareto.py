"""The decision view: the Pareto frontier (a pure function), throughput per device and per
dollar, the best configuration per SLO, and the section over a hand-made sweep."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from harness import cli
from harness.measuring.checks import parse_checks
from harness.reporting.pareto import (
    PER_DEVICE,
    PER_DOLLAR,
    PER_USER,
    best_under,
    decision_points,
    devices_of,
    pareto_front,
    short_labels,
)
from harness.reporting.results import load


def front(xs: list[float], ys: list[float]) -> tuple[list[bool], list[str]]:
    points = pd.DataFrame({"x": xs, "y": ys, "variant": [f"v{i}" for i in range(len(xs))]})
    mask, notes = pareto_front(points, "x", "y")
    return mask.tolist(), notes


def test_dominated_points_are_left_off_the_frontier() -> None:
    # (3, 1) and (1, 3) trade off; (2, 2) too; (1, 1) is beaten by all; (2, 1) by (2, 2)
    mask, notes = front([3, 1, 2, 1, 2], [1, 3, 2, 1, 1])
    assert mask == [True, True, True, False, False]
    assert notes == []


def test_ties_keep_both_identical_points_and_drop_one_beaten_on_one_axis_only() -> None:
    mask, _ = front([2, 2, 2, 1], [5, 5, 4, 5])
    assert mask == [True, True, False, False]


def test_missing_or_nan_metrics_are_skipped_with_a_note() -> None:
    mask, notes = front([1.0, math.nan, 5.0, 2.0], [1.0, 9.0, math.inf, None])  # type: ignore[list-item]
    assert mask == [True, False, False, False]
    assert len(notes) == 1 and "3 configuration(s)" in notes[0] and "v1, v2, v3" in notes[0]


def test_devices_multiply_the_parallel_sizes_from_the_engine_then_the_config() -> None:
    assert devices_of({}, {}) == 1
    assert devices_of({"engine": {"tensor_parallel_size": 4}}, {}) == 4
    imported = {"settings": {"tensor_parallel_size": 2, "data_parallel_size": 2}}
    assert devices_of({}, imported) == 4
    # the engine's own facts win over the config
    assert devices_of({"engine": {"tensor_parallel_size": 8}}, imported) == 16


def test_labels_name_the_varying_keys_by_their_last_part() -> None:
    variants = pd.DataFrame(
        {
            "variant": ["a", "b"],
            "engine.max_num_seqs": [8, 16],
            "variant_group": ["int8", "int8"],  # constant: not in the label
            "engine.kv_cache": ["paged", "contiguous"],
        }
    )
    labels = short_labels(variants, ["engine.max_num_seqs", "variant_group", "engine.kv_cache"])
    assert labels.tolist() == [
        "max_num_seqs=8 kv_cache=paged",
        "max_num_seqs=16 kv_cache=contiguous",
    ]


# a hand-made sweep ---------------------------------------------------------------------------
def make_sweep(root: Path, jobs: list[dict[str, Any]]) -> Path:
    """A sweep folder as Hydra's launcher leaves it: sweep.csv, job folders with
    .hydra/overrides.yaml, summary.json and config.yaml (only what the report reads)."""
    root.mkdir(parents=True)
    (root / "sweep.csv").write_text("job\n" + "".join(f"{k}\n" for k in range(len(jobs))))
    for k, job in enumerate(jobs):
        folder = root / str(k)
        (folder / ".hydra").mkdir(parents=True)
        overrides = [f"{key}={value}" for key, value in job["overrides"].items()]
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        config: dict[str, Any] = {"engine": {}, "run": job.get("run", {})}
        for key, value in job["overrides"].items():
            section, _, name = key.partition(".")
            config.setdefault(section, {})[name] = value
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        summary = {
            "status": job.get("status", "complete"),
            "metrics": job["metrics"],
            "engine": job.get("engine", {}),
            "hardware": job.get("hardware", {"name": "h100"}),
        }
        (folder / "summary.json").write_text(json.dumps(summary))
    return root


def metrics(tok_per_s: float, tpot: float, ttft_p99: float) -> dict[str, float]:
    return {
        "output_tok_per_s": tok_per_s,
        "tpot_p50_s": tpot,
        "tpot_p99_s": tpot * 1.5,
        "ttft_p99_s": ttft_p99,
        "num_completed": 32,
    }


JOBS = [
    # max_num_seqs=4: fast per user, little throughput
    {
        "overrides": {"engine.max_num_seqs": 4, "engine.quantization": "int8"},
        "metrics": metrics(400.0, 0.010, 0.5),
    },
    # max_num_seqs=16: more throughput, slower per user
    {
        "overrides": {"engine.max_num_seqs": 16, "engine.quantization": "int8"},
        "metrics": metrics(1200.0, 0.020, 1.5),
    },
    # dominated by the int8 max_num_seqs=16 on both axes
    {
        "overrides": {"engine.max_num_seqs": 16, "engine.quantization": "none"},
        "metrics": metrics(1000.0, 0.025, 3.0),
    },
    # the most throughput, on two devices: per device still above max_num_seqs=16, but it
    # misses a TTFT bound of 2 s
    {
        "overrides": {"engine.max_num_seqs": 64, "engine.quantization": "int8"},
        "metrics": metrics(2600.0, 0.040, 4.0),
        "engine": {"tensor_parallel_size": 2},
    },
]


def test_points_divide_by_devices_and_cost(tmp_path: Path) -> None:
    jobs = [dict(job, hardware={"name": "h100", "cost_per_hour": 2.0}) for job in JOBS]
    res = load(make_sweep(tmp_path / "sweep", jobs))
    points, notes = decision_points(res)
    assert notes == []
    by = points.set_index("label")
    tp2 = by.loc["max_num_seqs=64 quantization=int8"]
    assert tp2["devices"] == 2
    assert tp2[PER_DEVICE] == pytest.approx(1300.0)
    assert tp2[PER_USER] == pytest.approx(25.0)
    # 2600 tok/s x 3600 s over 2 devices x $2 an hour
    assert tp2[PER_DOLLAR] == pytest.approx(2600.0 * 3600 / 4.0)
    checks = parse_checks("ttft_p99_s <= 2", "--slo")
    assert best_under(points, checks)["label"] == "max_num_seqs=16 quantization=int8"
    assert best_under(points, parse_checks("ttft_p99_s <= 0.1", "--slo")) is None


def test_report_draws_the_frontier_and_names_the_best_per_slo(tmp_path: Path) -> None:
    jobs = [
        *JOBS,
        {
            "overrides": {"engine.max_num_seqs": 32, "engine.quantization": "int4"},
            "metrics": {"num_completed": 0},
            "status": "failed",
        },
    ]
    jobs[0] = dict(jobs[0], run={"slo": {"ttft_s": 1.0, "tpot_s": None, "e2e_s": None}})
    sweep = make_sweep(tmp_path / "sweep", jobs)
    out = tmp_path / "report"
    args = [
        "report",
        str(sweep),
        "--out",
        str(out),
        "--slo",
        "ttft_p99_s <= 2",
        "--slo",
        "tpot_p99_s <= 0.001",
        "--slo",
        "ttft_p97_s <= 1",
    ]
    assert cli.main(args) == 0
    markdown = (out / "report.md").read_text()
    assert (out / "pareto.png").stat().st_size > 5000
    section = markdown.split("## Pareto frontier and decision")[1].split("\n## ")[0]
    assert "Frontier configurations (3 of 4)" in section
    frontier_rows = [line for line in section.splitlines() if line.startswith("| max_num_seqs")]
    assert [r.split("|")[1].strip() for r in frontier_rows] == [
        "max_num_seqs=64 quantization=int8",
        "max_num_seqs=16 quantization=int8",
        "max_num_seqs=4 quantization=int8",
    ]
    assert "1 configuration(s) did not complete: left out" in section
    assert "| ttft_p99_s <= 2 | max_num_seqs=16 quantization=int8 | 1,200 |" in section
    assert "| tpot_p99_s <= 0.001 | none meets it |" in section
    # a metric no configuration has is said, not read as "none meets it"
    assert "| ttft_p97_s <= 1 | no configuration has ttft_p97_s |" in section
    # the sweep's own run.slo, as a bound on p99
    assert "| ttft_p99_s <= 1 | max_num_seqs=4 quantization=int8 |" in section
    assert "tokens per $" not in section  # no cost stated


def test_a_bad_slo_is_named_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = make_sweep(tmp_path / "sweep", JOBS)
    out = tmp_path / "report"
    assert cli.main(["report", str(sweep), "--out", str(out), "--slo", "tpot_p99 <= 1"]) == 2
    err = capsys.readouterr().err
    assert "--slo[0]: 'tpot_p99' is not a metric" in err
    assert not out.exists()


def test_the_capacity_search_answer_is_shown_once(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path / "load_sweep", JOBS[:2])
    search = {
        "over": "rate",
        "slo": ["ttft_p99_s <= 2"],
        "outcome": "found",
        "max_rate_at_slo": 6.5,
        "bracket": {"meets": {"job": 3, "load": 6.5}, "misses": {"job": 4, "load": 7.0}},
        "points": [],
        "num_points": 5,
        "note": "",
    }
    (sweep / "search.json").write_text(json.dumps(search))
    out = tmp_path / "report"
    assert cli.main(["report", str(sweep), "--out", str(out)]) == 0
    markdown = (out / "report.md").read_text()
    # once, in the capacity search's own section (the decision section does not repeat it)
    assert markdown.count("## Capacity search") == 1
    assert "max_rate_at_slo = 6.5 req/s (meets at 6.5, misses at 7; 5 runs)" in markdown


def test_a_sweep_over_the_variant_group_is_labelled_by_its_value(tmp_path: Path) -> None:
    """The runs table's label column is called `variant`: a sweep over the `variant` config
    group (variant=int8,int4_g32) reads the group's value back from the job's overrides."""
    jobs = [
        {"overrides": {"variant": name, "engine.max_num_seqs": seqs}, "metrics": metrics(t, p, 1)}
        for name, seqs, t, p in (("int8", 2, 50.0, 0.02), ("int4_g32", 8, 60.0, 0.05))
    ]
    points, _ = decision_points(load(make_sweep(tmp_path / "sweep", jobs)))
    assert sorted(points["label"]) == [
        "variant=int4_g32 max_num_seqs=8",
        "variant=int8 max_num_seqs=2",
    ]


def test_a_configuration_without_tpot_is_named_not_a_crash(tmp_path: Path) -> None:
    jobs = [
        dict(job, metrics={"output_tok_per_s": job["metrics"]["output_tok_per_s"]})
        for job in JOBS[:2]
    ]
    points, _ = decision_points(load(make_sweep(tmp_path / "sweep", jobs)))
    assert points[PER_USER].isna().all() and points[PER_DEVICE].tolist() == [400.0, 1200.0]
    mask, notes = pareto_front(points, PER_USER, PER_DEVICE, label="label")
    assert not mask.any() and "2 configuration(s) without" in notes[0]


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{}", "record 0: over: None is invalid; allowed: rate|concurrency"),
        ('{"searches": [{}]}', "record 0: over: None is invalid"),
        ('{"over": "rate", "outcome": "found"}', "max_rate_at_slo: null with outcome 'found'"),
        (
            '{"over": "rate", "outcome": "found", "max_rate_at_slo": 5, "slo": ["ttft_p99_s <= 2"],'
            ' "points": [1, "x"], "num_points": 2, "bracket": {"meets": {"load": 5}}}',
            "points: not a list of objects",
        ),
        (
            '{"over": "rate", "outcome": "found", "max_rate_at_slo": "abc"}',
            "max_rate_at_slo: 'abc' is invalid",
        ),
        ("{not json", "not valid JSON"),
        ("", "empty file"),
    ],
)
def test_a_damaged_search_json_is_a_note_not_a_traceback(
    tmp_path: Path, content: str, said: str
) -> None:
    """`inferlab report` over a sweep whose search.json lost keys ({}, a found outcome without
    its answer, points that are not objects) raised KeyError / TypeError / AttributeError; an
    unreadable file left the section out without a word. Now the section says what was left
    out and the report is written."""
    sweep = make_sweep(tmp_path / "load_sweep", JOBS[:2])
    (sweep / "search.json").write_text(content)
    out = tmp_path / "report"
    assert cli.main(["report", str(sweep), "--out", str(out)]) == 0
    section = (out / "report.md").read_text().split("## Capacity search")[1]
    assert f"Left out: {sweep / 'search.json'}" in section and said in section


def test_the_search_figure_draws_a_value_of_zero() -> None:
    """`value or nan` drew a run whose SLO metric was 0 (num_failed <= 0) as a gap."""
    from harness.reporting import figures

    record = {
        "over": "rate",
        "slo": ["num_failed <= 0"],
        "points": [
            {"load": 1.0, "meets": True, "metrics": {"num_failed": 0}},
            {"load": 2.0, "meets": False, "metrics": {"num_failed": None}},
        ],
    }
    fig = figures.capacity_search([record])
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == [1.0, 2.0]
    ys = list(line.get_ydata())
    assert ys[0] == 0.0 and math.isnan(ys[1])
