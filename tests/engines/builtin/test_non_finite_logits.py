"""Logits that turn NaN or infinite (a checkpoint whose weights hold a NaN) fail the step's
requests with the reason, instead of sampling token 0 over and over: before, a NaN weight gave
requests of all-zero token ids, finished by length, and a run marked complete with a
throughput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import run_on_checkpoint, write_tiny_checkpoint

from engines.builtin import LLM, SamplingParams

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("poisoned", "kind"),
    [
        ({"model.layers.0.mlp.down_proj.weight": NAN}, "NaN"),  # spreads to every logit
        ({"lm_head.weight": INF}, "inf"),  # one vocabulary row's logit
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_fail_the_requests_with_the_reason(
    tmp_path: Path, poisoned: dict[str, float], kind: str, temperature: float
) -> None:
    folder = write_tiny_checkpoint(tmp_path / "ckpt", poisoned=poisoned)
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128, max_num_seqs=4)
    outputs = llm.generate(
        ["hello there", "another prompt"], SamplingParams(max_tokens=4, temperature=temperature)
    )
    for out in outputs:
        assert out.token_ids == [] and out.finish_reason is None, out
        assert out.error is not None and (
            f"non-finite logits ({kind}) at step 0: the model's weights or config produce "
            f"{kind}" in out.error
        ), out.error
    assert not llm.engine.has_unfinished_requests()  # their KV was freed


def test_the_same_checkpoint_with_finite_weights_generates(tmp_path: Path) -> None:
    """The poisoned checkpoints above differ from this one only in one weight."""
    llm = LLM(model=str(write_tiny_checkpoint(tmp_path / "ckpt")), dtype="float32")
    (out,) = llm.generate(["hello there"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.error is None and len(out.token_ids) == 4


def test_inferlab_run_on_nan_weights_fails_with_the_reason(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(
        tmp_path / "ckpt", poisoned={"model.layers.1.self_attn.v_proj.weight": NAN}
    )
    run_dir = tmp_path / "run"
    result = run_on_checkpoint(folder, run_dir, num_requests=3)
    assert result.returncode == 1, result.stderr
    reason = "non-finite logits (NaN) at step 0: the model's weights or config produce NaN"
    assert reason in result.stderr.strip().splitlines()[-1], result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert summary["error"].startswith("every measured request failed (3 of 3)"), summary
    assert reason in summary["error"]
    metrics = summary["metrics"]
    assert metrics["num_failed"] == 3 and metrics["output_tok_per_s"] is None, metrics
