"""The gate end to end on model=tiny: real run folders, and A/B mode's rounds in worker
processes. Timing verdicts are not asserted (they depend on the machine); counters are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import cli
from harness.gating import ab
from harness.gating import cli as gate
from harness.gating.ab import compose_config
from harness.running.experiment import run_experiment

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "model=tiny",
    "workload.num_requests=3",
    "workload.input_len=16",
    "workload.output_len=4",
    "run.warmup_requests=0",
    "engine.num_threads=1",
    "engine.max_model_len=64",
]


def test_a_no_cache_candidate_fails_on_its_counters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, kv in (("base", "contiguous"), ("cand", "none")):
        summary = run_experiment(
            compose_config([*TINY, f"engine.kv_cache={kv}"]), tmp_path / name, progress=False
        )
        assert summary["status"] == "complete", summary["error"]
    code = gate.main(
        [
            "--baseline",
            str(tmp_path / "base"),
            "--candidate",
            str(tmp_path / "cand"),
            "--json",
            str(tmp_path / "gate.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "configuration differs: engine.kv_cache: 'contiguous' -> 'none'" in out
    rows = {row["metric"]: row for row in json.loads((tmp_path / "gate.json").read_text())["rows"]}
    # recomputing every context costs prefill tokens: the counter that fails the gate
    prefill = rows["prefill_tokens_total"]
    assert prefill["verdict"] == "regression" and prefill["candidate"] > prefill["baseline"]
    assert rows["output_tokens_total"]["verdict"] == "pass"
    assert rows["output_tok_per_s"]["verdict"] == "inconclusive"  # one run per side
    # the same runs against themselves: counters equal, timing still inconclusive
    assert (
        gate.main(["--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "base")])
        == 2
    )


def copy_checkout(dest: Path) -> Path:
    """A copy of this checkout's code and configs with two marks: a model preset only it has
    (composition reads its configs/) and a provenance field (its runs import its code)."""
    for name in ("engines", "harness", "workloads", "configs"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "configs" / "model" / "tiny-copy.yaml").write_text(
        (REPO / "configs" / "model" / "tiny.yaml").read_text()
    )
    with (dest / "harness" / "measuring" / "provenance.py").open("a") as handle:
        handle.write(
            "\n_collect = collect\n\n\ndef collect(config):\n"
            "    return {**_collect(config), 'code_marker': 'copy'}\n"
        )
    return dest


def test_ab_mode_writes_rounds_and_paired_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "ab"
    code = cli.main(
        [
            "gate",
            "ab",
            "--baseline",
            "",
            "--candidate",
            "model=tiny-copy ++engine.debug_step_delay_fraction=0.5",
            "--candidate-code",
            str(copy_checkout(tmp_path / "copy")),
            "--common",
            " ".join(TINY),
            "--rounds",
            "3",
            "--allow-few-rounds",
            "--out",
            str(out_dir),
        ]
    )
    out = capsys.readouterr().out
    assert code == 2, out  # counters equal; 3 rounds are too few to decide timing
    assert "3 rounds < min_samples 5" in out
    names = {p.name for p in out_dir.iterdir()}
    rounds = {f"round-{k}-{side}" for k in range(3) for side in "ab"}
    assert rounds | {"warmup-0-a", "warmup-0-b", "ab.json", "gate.md"} <= names
    for name in rounds:
        summary = json.loads((out_dir / name / "summary.json").read_text())
        assert summary["status"] == "complete"
        assert (out_dir / name / "requests.parquet").is_file()
    ab = json.loads((out_dir / "ab.json").read_text())
    assert ab["status"] == "complete" and ab["exit_code"] == 2
    assert ab["candidate_overrides"] == [
        "model=tiny-copy",
        "++engine.debug_step_delay_fraction=0.5",
    ]
    assert not ab["identical_configs"]
    assert [r["order"] for r in ab["rounds"]] == [["a", "b"], ["b", "a"], ["a", "b"]]
    for entry in ab["rounds"]:
        a = json.loads((out_dir / entry["a"] / "summary.json").read_text())["metrics"]
        b = json.loads((out_dir / entry["b"] / "summary.json").read_text())["metrics"]
        assert entry["ratios"]["output_tok_per_s"] == pytest.approx(
            b["output_tok_per_s"] / a["output_tok_per_s"]
        )
        config = (out_dir / entry["b"] / "config.yaml").read_text()
        assert "debug_step_delay_fraction: 0.5" in config  # model=tiny-copy composed: copy
        marks = [
            json.loads((out_dir / entry[side] / "provenance.json").read_text()).get("code_marker")
            for side in "ab"
        ]
        assert marks == [None, "copy"]  # each side ran its own checkout
    rows = {row["metric"]: row for row in ab["result"]["rows"]}
    assert ab["result"]["paired"] and rows["output_tok_per_s"]["n_baseline"] == 3
    assert rows["prefill_tokens_total"]["verdict"] == "pass"
    # re-gating the folder gives the same answer
    assert gate.main(["--ab", str(out_dir)]) == 2
    assert "paired ratios over A/B rounds" in capsys.readouterr().out


def test_another_checkout_composes_with_its_own_engine_options(tmp_path: Path) -> None:
    """A baseline from before an engine option was added must not get that option: composed
    with this checkout's schemas it did, and its engine refused it (every PR adding an option
    was inconclusive against its target)."""
    copy = copy_checkout(tmp_path / "copy")
    config_py = copy / "engines" / "builtin" / "config.py"
    text = config_py.read_text()
    start = text.index("    long_prefill_token_threshold: int = option(")
    end = text.index("    )\n", start) + len("    )\n")
    config_py.write_text(text[:start] + text[end:])
    assert "long_prefill_token_threshold" in ab.compose_config(TINY)["engine"]
    theirs = ab.compose_config(TINY, copy)
    assert "long_prefill_token_threshold" not in theirs["engine"]
    assert theirs["engine"]["max_num_seqs"] == ab.compose_config(TINY)["engine"]["max_num_seqs"]
    with pytest.raises(ab.ABError, match=r"engine\.max_num_seqs"):
        ab.compose_config([*TINY, "engine.max_num_seqs=many"], copy)
