"""LoRA traffic as a workload option (issue 41): every workload type assigns adapters to its
requests round-robin, at random or Zipf-skewed, to a fraction of its sessions (every turn of a
session alike), drawn with the seed on a stream of its own (nothing else changes); bad values
are named. A run over it records each request's adapter, each step's adapters and rows, and the
engine's adapter loads and slot evictions."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from checkpoints import write_random_lora
from test_cancellation import TYPES, build

ADAPTERS = ["a", "b", "c", "d"]


def adapters_of(requests: list[Any]) -> list[str | None]:
    return [w.request.lora for w in requests]


def test_round_robin_takes_the_adapters_in_turn() -> None:
    requests, info = build({**TYPES["synthetic"], "lora_adapters": ADAPTERS})
    assert adapters_of(requests) == [ADAPTERS[k % 4] for k in range(30)]
    assert info["lora_requests"] == {"a": 8, "b": 8, "c": 7, "d": 7}


@pytest.mark.parametrize("kind", sorted(TYPES))
@pytest.mark.parametrize("assignment", ["round_robin", "random", "zipf"])
def test_the_seed_decides_and_nothing_else_changes(kind: str, assignment: str) -> None:
    options = {**TYPES[kind], "lora_adapters": ADAPTERS, "lora_assignment": assignment}
    requests, _ = build(options)
    again, _ = build(options)
    assert adapters_of(requests) == adapters_of(again)
    plain, _ = build(TYPES[kind])
    assert [(w.request_id, w.request.prompt, w.arrival_s) for w in requests] == [
        (w.request_id, w.request.prompt, w.arrival_s) for w in plain
    ]
    # every turn of a session runs under its first turn's adapter
    first = {w.request.session_id: w.request.lora for w in requests if w.follows is None}
    for w in requests:
        if w.request.session_id is not None:
            assert w.request.lora == first[w.request.session_id]


def test_zipf_makes_the_first_adapters_hot_and_a_fraction_leaves_the_rest_on_the_base() -> None:
    options = {**TYPES["synthetic"], "num_requests": 400, "lora_adapters": ADAPTERS}
    skewed, _ = build({**options, "lora_assignment": "zipf", "lora_zipf_exponent": 1.5})
    counts = Counter(adapters_of(skewed))
    assert counts["a"] > counts["b"] > counts["d"] > 0  # weights 1, 0.35, 0.19, 0.125
    half, info = build({**options, "lora_fraction": 0.5})
    assert adapters_of(half).count(None) == 200 and sum(info["lora_requests"].values()) == 200


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("lora_adapters", ["a", "a"], "a list of distinct adapter names"),
        ("lora_adapters", "a", "a list of distinct adapter names"),
        ("lora_assignment", "hot", "round_robin|random|zipf"),
        ("lora_fraction", 1.5, "a number in [0, 1]"),
        ("lora_zipf_exponent", 0, "a number > 0"),
    ],
)
def test_bad_values_are_named(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError, match=f"workload.{field}") as info:
        build({**TYPES["synthetic"], field: value})
    assert allowed in str(info.value)


def test_a_run_records_adapters_per_request_and_step(tmp_path: Path) -> None:
    from harness.cli import main as inferlab

    folders = {
        name: write_random_lora(tmp_path / name, rank=4 * (k + 1), seed=k)
        for k, name in enumerate(ADAPTERS[:3])
    }
    modules = ", ".join(f"{name}: {path}" for name, path in folders.items())
    out = tmp_path / "run"
    code = inferlab(
        [
            "run",
            "model=tiny",
            "engine.enable_lora=true",
            "engine.max_loras=2",
            "engine.max_lora_rank=16",
            f"engine.lora_modules={{{modules}}}",
            "workload.num_requests=12",
            "workload.output_len=6",
            "workload.lora_adapters=[a,b,c]",
            "workload.lora_fraction=0.75",
            "run.warmup_requests=0",
            f"hydra.run.dir={out}",
        ]
    )
    assert code == 0
    requests = pd.read_parquet(out / "requests.parquet")
    assert (requests["status"] == "ok").all()
    assert requests["lora"].isna().sum() == 3 and set(requests["lora"].dropna()) == {"a", "b", "c"}
    steps = pd.read_parquet(out / "steps.parquet")
    assert steps["lora_adapters"].max() == 2  # two slots: never three adapters in a step
    assert (steps["lora_rows_max"] <= steps["lora_rows"]).all() and steps["lora_rows"].sum() > 0
    lora = json.loads((out / "summary.json").read_text())["engine"]["lora"]
    assert lora["max_loras"] == 2 and lora["adapters"]["c"]["rank"] == 12
    assert lora["lora_disk_loads"] >= 3 and lora["lora_slot_writes"] >= 3
    # the report breaks the requests down by adapter, the base model's beside them
    from harness.reporting.adapters import BASE
    from harness.reporting.report import write_report

    report = write_report([out], tmp_path / "report")["markdown"].read_text()
    section = report.split("## LoRA adapters", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| run ")]
    assert sorted(line.split(" | ")[1] for line in rows) == sorted([BASE, "a", "b", "c"])


@pytest.mark.parametrize(
    ("engine", "words"),
    [
        (["engine.enable_lora=true", "engine.lora_dummy_adapters=2"], "allowed: dummy-0, dummy-1"),
        ([], "engine=builtin serves no adapters here"),
    ],
    ids=["unknown", "no_lora"],
)
def test_an_adapter_the_engine_does_not_serve_fails_the_run_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: list[str], words: str
) -> None:
    """Before, half the requests failed one by one and the run measured the other half."""
    from harness.cli import main as inferlab

    with pytest.raises(SystemExit) as exited:
        inferlab(
            ["run", "model=tiny", *engine, "workload.num_requests=4",
             "workload.lora_adapters=[dummy-0,nope]", f"hydra.run.dir={tmp_path / 'run'}"]
        )  # fmt: skip
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert exited.value.code == 2, text
    assert "workload.lora_adapters: " in text and "are not served" in text and words in text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "lora_adapters" in summary["error"]
