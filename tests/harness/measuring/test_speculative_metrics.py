"""Speculative decoding's run metrics from a real run's tables: acceptance overall and by draft
position, and the roofline of the verifying steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.measuring.metrics import SPEC_POSITIONS, compute_summary
from harness.measuring.roofline import prefill_only, verifying
from harness.running.experiment import run_experiment

K = 4
CONFIG = {
    "engine": {
        "dtype": "float32",
        "max_model_len": 128,
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
        },
    },
    "model": {"name": "tiny"},
    "workload": {"type": "synthetic", "num_requests": 4, "input_len": 24, "output_len": 40},
    "run": {"warmup_requests": 0, "monitor": {"enabled": False}},
}


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("spec")
    summary = run_experiment(CONFIG, run_dir, progress=False)
    assert summary["status"] == "complete", summary.get("error")
    return run_dir, summary["metrics"]


def test_acceptance_by_position_from_the_steps_table(spec_run: tuple[Path, dict]) -> None:
    run_dir, metrics = spec_run
    steps = pd.read_parquet(run_dir / "steps.parquet")
    requests = pd.read_parquet(run_dir / "requests.parquet")
    proposed, kept = np.zeros(K), np.zeros(K)
    for drafted, accepted in zip(
        steps["spec_drafts_by_position"], steps["spec_accepted_by_position"], strict=True
    ):
        proposed[: len(drafted)] += drafted
        kept[: len(accepted)] += accepted
    assert proposed[0] == requests["spec_steps"].sum() > 0  # every verifying row, once
    assert proposed.sum() == requests["spec_draft_tokens"].sum()
    assert kept.sum() == requests["spec_accepted_tokens"].sum() > 0
    rates = [metrics.get(f"spec_acceptance_rate_pos{i}") for i in range(1, SPEC_POSITIONS + 1)]
    expected = [kept[i] / proposed[i] for i in range(K) if proposed[i]]
    assert rates[: len(expected)] == pytest.approx(expected)
    assert all(rate is None for rate in rates[len(expected) :])  # no drafts past k
    per_request = requests["spec_accepted_tokens"] / requests["spec_draft_tokens"]
    assert requests["spec_acceptance_rate"].to_numpy() == pytest.approx(
        per_request.to_numpy(), nan_ok=True
    )
    lengths = (requests["spec_accepted_tokens"] + requests["spec_steps"]) / requests["spec_steps"]
    assert requests["spec_mean_accepted_length"].to_numpy() == pytest.approx(
        lengths.to_numpy(), nan_ok=True
    )
    # pooled over positions, the per-position counts give the overall rate
    assert metrics["spec_acceptance_rate"] == pytest.approx(kept.sum() / proposed.sum())


def test_verifying_steps_have_their_own_roofline(spec_run: tuple[Path, dict]) -> None:
    run_dir, metrics = spec_run
    steps = pd.read_parquet(run_dir / "steps.parquet")
    verifies = verifying(steps)
    assert verifies.any() and not (prefill_only(steps) & verifies).any()
    # k+1 tokens a sequence for one read of the weights: more FLOPs per byte than a decode
    assert metrics["flops_per_byte_verify_mean"] > 1.5 * metrics["flops_per_byte_decode_mean"]
    if "mbu" in steps and steps["mbu"].notna().any():
        assert metrics["mbu_verify_mean"] > 0


def test_a_run_without_drafts_reports_no_speculative_metrics(spec_run: tuple[Path, dict]) -> None:
    run_dir, _ = spec_run
    requests = pd.read_parquet(run_dir / "requests.parquet")
    steps = pd.read_parquet(run_dir / "steps.parquet")
    plain_steps = steps.assign(
        spec_draft_tokens=0, spec_drafts_by_position=None, spec_accepted_by_position=None
    )
    plain = requests.assign(spec_steps=0, spec_draft_tokens=0, spec_accepted_tokens=0)
    tokens = pd.read_parquet(run_dir / "tokens.parquet")
    summary = compute_summary(plain, tokens, plain_steps)
    assert not [name for name in summary if "spec_" in name or "verify" in name]
