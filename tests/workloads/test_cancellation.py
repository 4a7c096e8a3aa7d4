"""Cancellation as a workload feature: every workload type takes cancel_fraction and
cancel_after_s; exactly round(fraction * n) requests are marked, drawn with the seed (the same
seed, the same ones), and nothing else about the workload changes; bad values are named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import workloads

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"

TYPES: dict[str, dict[str, Any]] = {
    "synthetic": {"type": "synthetic", "num_requests": 30, "input_len": 8, "output_len": 4},
    "prompts": {
        "type": "prompts",
        "path": str(TRACES / "mt_bench_questions.jsonl"),
        "format": "mt_bench",
        "num_requests": 30,
        "output_len": 4,
    },
    "trace": {
        "type": "trace",
        "path": str(TRACES / "AzureLLMInferenceTrace_conv.csv"),
        "format": "azure",
        "num_requests": 30,
        "max_input_len": 64,
        "max_output_len": 8,
    },
}


def build(options: dict[str, Any]) -> tuple[list[workloads.WorkloadRequest], dict[str, Any]]:
    workload = workloads.from_config(options)
    requests = workload.build()
    return requests, workload.info


def cancelled(requests: list[workloads.WorkloadRequest]) -> list[str]:
    return [w.request_id for w in requests if w.cancel_after_s is not None]


@pytest.mark.parametrize("kind", sorted(TYPES))
@pytest.mark.parametrize(("fraction", "count"), [(0.2, 6), (0.5, 15), (1.0, 30), (0.0, 0)])
def test_exactly_the_planned_count_is_marked(kind: str, fraction: float, count: int) -> None:
    options = {**TYPES[kind], "cancel_fraction": fraction, "cancel_after_s": 0.5}
    requests, info = build(options)
    assert len(requests) == 30
    marked = cancelled(requests)
    assert len(marked) == count and info["cancel_planned"] == count
    assert all(w.cancel_after_s == 0.5 for w in requests if w.request_id in marked)
    assert info["cancel_after_s"] == (0.5 if count else None)


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_the_seed_picks_them_and_nothing_else_changes(kind: str) -> None:
    options = {**TYPES[kind], "cancel_fraction": 0.3, "cancel_after_s": 1}
    first, _ = build(options)
    again, _ = build(options)
    other, _ = build({**options, "seed": 1})
    plain, _ = build(TYPES[kind])
    assert cancelled(first) == cancelled(again)
    assert cancelled(first) != cancelled(other)
    # the prompts, lengths and arrivals are those of the workload without cancellation
    assert [(w.request.prompt, w.arrival_s) for w in first] == [
        (w.request.prompt, w.arrival_s) for w in plain
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"cancel_fraction": 1.5, "cancel_after_s": 1},
            r"^workload\.cancel_fraction: 1\.5 is invalid; allowed: a number in \[0, 1\]",
        ),
        (
            {"cancel_fraction": True, "cancel_after_s": 1},
            r"^workload\.cancel_fraction: True is invalid",
        ),
        (
            {"cancel_fraction": 0.5},
            r"^workload\.cancel_after_s: None is invalid; allowed: a number >= 0 \(seconds "
            r"after sending\) when cancel_fraction=0\.5 > 0",
        ),
        (
            {"cancel_fraction": 0.5, "cancel_after_s": -1},
            r"^workload\.cancel_after_s: -1 is invalid; allowed: a number >= 0",
        ),
    ],
)
def test_bad_cancellation_is_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        workloads.from_config({**TYPES["synthetic"], **options})
