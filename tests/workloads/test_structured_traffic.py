"""Structured traffic as a workload feature: every workload type takes structured_fraction and
structured_kinds; exactly round(fraction * n) requests carry a constraint of the kinds asked,
drawn with the seed (the same seed, the same ones), nothing else about the workload changes,
cancellation draws the same requests as without it; bad values are named. A run over it
records each request's kind and validity, and the summary its validity and both classes'
latencies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from test_cancellation import TYPES, build

from engines.structured_outputs import StructuredOutputsParams
from workloads.structured import shipped_constraints


def constrained(requests: list[Any]) -> dict[str, str]:
    return {
        w.request_id: w.request.sampling.structured_outputs.kind
        for w in requests
        if w.request.sampling.structured_outputs is not None
    }


@pytest.mark.parametrize("kind", sorted(TYPES))
@pytest.mark.parametrize(("fraction", "count"), [(0.2, 6), (1.0, 30), (0.0, 0)])
def test_exactly_the_planned_count_carries_a_constraint(
    kind: str, fraction: float, count: int
) -> None:
    options = {**TYPES[kind], "structured_fraction": fraction, "structured_kinds": ["regex"]}
    requests, info = build(options)
    marked = constrained(requests)
    assert len(marked) == count == info["structured_planned"]
    assert set(marked.values()) <= {"regex"}
    again, _ = build(options)
    assert constrained(again) == marked  # the seed decides
    plain, _ = build(TYPES[kind])
    assert [(w.request_id, w.request.prompt, w.arrival_s) for w in requests] == [
        (w.request_id, w.request.prompt, w.arrival_s) for w in plain
    ]
    cancelling = {**options, "cancel_fraction": 0.5, "cancel_after_s": 1.0}
    with_cancel, _ = build(cancelling)
    assert constrained(with_cancel) == marked  # its own seed stream


def test_the_kinds_asked_are_drawn_from_the_shipped_constraints() -> None:
    options = {**TYPES["synthetic"], "structured_fraction": 1.0}
    requests, info = build({**options, "structured_kinds": ["json", "choice"]})
    assert set(constrained(requests).values()) == {"json", "choice"}
    names = {name for kind in ("json", "choice") for name, _ in shipped_constraints()[kind]}
    assert set(info["structured_constraints"]) <= names
    assert sum(info["structured_constraints"].values()) == 30


def test_every_shipped_constraint_is_valid_and_bounded() -> None:
    for kind, items in shipped_constraints().items():
        assert items, kind
        for name, params in items:
            assert isinstance(params, StructuredOutputsParams) and params.kind == kind, name


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("structured_fraction", 1.5, "a number in [0, 1]"),
        ("structured_fraction", "half", "a number in [0, 1]"),
        ("structured_kinds", [], "a non-empty list of distinct"),
        ("structured_kinds", ["yaml"], "json|json_object|regex|choice"),
        ("structured_kinds", ["json", "json"], "a non-empty list of distinct"),
    ],
)
def test_bad_values_are_named(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError, match=f"workload.{field}") as info:
        build({**TYPES["synthetic"], field: value})
    assert allowed in str(info.value)


def test_a_run_records_validity_and_both_classes_latencies(tmp_path: Path) -> None:
    from harness.cli import main as inferlab

    out = tmp_path / "run"
    code = inferlab(
        [
            "run",
            "model=tiny",
            "workload.num_requests=8",
            "workload.output_len=48",
            "workload.structured_fraction=0.5",
            "workload.structured_kinds=[regex,choice]",
            f"hydra.run.dir={out}",
        ]
    )
    assert code == 0
    requests = pd.read_parquet(out / "requests.parquet")
    guided = requests[requests["structured"].notna()]
    assert len(guided) == 4 and set(guided["structured"]) <= {"regex", "choice"}
    assert guided["structured_valid"].tolist() == [True] * 4  # the grammar ends them
    assert requests[requests["structured"].isna()]["structured_valid"].isna().all()
    # a constraint's first request paid its compilation, the ones after it hit the cache
    hits = guided["structured_cache_hit"].astype(bool)
    assert (~hits).sum() >= 1 and (guided[~hits]["structured_compile_s"] > 0).all()
    assert (guided[hits]["structured_compile_s"] == 0).all()
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    assert metrics["structured_requests"] == 4 and metrics["structured_validity"] == 1.0
    for name in ("ttft_p50_s_structured", "tpot_p50_s_free"):
        assert metrics[name] > 0
    steps = pd.read_parquet(out / "steps.parquet")
    assert steps["structured_rows"].max() >= 1 and steps["structured_mask_s"].sum() > 0
    step_time = (steps["end_s"] - steps["start_s"]).sum()
    assert metrics["structured_mask_fraction"] == pytest.approx(
        steps["structured_mask_s"].sum() / step_time
    )


def test_an_unenforced_run_judges_free_outputs_against_the_same_constraints(
    tmp_path: Path,
) -> None:
    """structured_enforce=false: the same requests get the same constraints, sent with none;
    their free outputs are judged against them (the validity the grammar buys)."""
    from harness.cli import main as inferlab

    options = {**TYPES["synthetic"], "structured_fraction": 0.5, "structured_kinds": ["regex"]}
    enforced, _ = build(options)
    free, info = build({**options, "structured_enforce": False})
    assert info["structured_enforced"] is False and not constrained(free)
    assert {w.request_id: w.expected_format for w in free if w.expected_format} == {
        w.request_id: w.request.sampling.structured_outputs
        for w in enforced
        if w.request.sampling.structured_outputs
    }
    runs = {}
    for enforce in ("true", "false"):
        out = tmp_path / enforce
        code = inferlab(
            ["run", "model=tiny", "workload.num_requests=8", "workload.output_len=24",
             "workload.structured_fraction=0.5", "workload.structured_kinds=[regex]",
             f"workload.structured_enforce={enforce}", f"hydra.run.dir={out}"]
        )  # fmt: skip
        assert code == 0
        runs[enforce] = (
            pd.read_parquet(out / "requests.parquet"),
            json.loads((out / "summary.json").read_text())["metrics"],
        )
    rows, metrics = runs["false"]
    judged = rows[rows["structured"].notna()]
    assert len(judged) == 4 and not judged["structured_enforced"].any()
    assert metrics["structured_validity"] < runs["true"][1]["structured_validity"] == 1.0
