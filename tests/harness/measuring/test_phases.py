"""Per-request phases and ITL spike attribution: gap labels on hand-made tables, then the
phase columns and labels of a real tiny-engine run with chunked prefill and preemption."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from engines.base import Finished, GenerationRequest
from engines.builtin import LLM
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.sampling_params import SamplingParams
from harness.measuring.metrics import REGISTRY, compute_summary
from harness.measuring.phases import CAUSES, itl_by_cause, label_gaps
from harness.run_folder import RunRecorder
from harness.running.driver import Driver
from workloads.request import WorkloadRequest


def steps_frame(rows: list[tuple[int, int, int]]) -> pd.DataFrame:
    """(step, prefill_tokens, num_preempted) rows."""
    return pd.DataFrame(rows, columns=["step", "prefill_tokens", "num_preempted"])


def tokens_frame(rows: list[tuple[str, int, int, float]]) -> pd.DataFrame:
    """(request_id, index, step, time_s) rows."""
    return pd.DataFrame(rows, columns=["request_id", "index", "step", "time_s"])


def test_gap_labels_follow_the_steps_they_span() -> None:
    steps = steps_frame(
        [
            (1, 10, 0),
            (2, 0, 0),
            (3, 5, 0),
            (4, 0, 0),
            (5, 0, 1),
            (6, 4, 0),
            (7, 0, 0),
            (8, 0, 0),
            (9, 3, 1),
        ]
    )
    tokens = tokens_frame(
        [
            ("a", 0, 1, 0.10),
            ("a", 1, 2, 0.11),
            ("a", 2, 3, 0.15),
            ("a", 3, 4, 0.16),
            # b: out of the batch in steps 5 and 6 (preempted in 5, recomputed in 6)
            ("b", 0, 3, 0.15),
            ("b", 1, 4, 0.16),
            ("b", 2, 6, 0.40),
            # c: a gap over steps 7-8 with only decodes; then step 9 prefills and preempts
            ("c", 0, 6, 0.40),
            ("c", 1, 8, 0.45),
            ("c", 2, 9, 0.60),
            # d: its second token's step is not in the steps table
            ("d", 0, 8, 0.45),
            ("d", 1, 11, 0.70),
        ]
    )
    gaps = label_gaps(tokens.sample(frac=1.0, random_state=0), steps)  # any row order
    labels = {(r.request_id, r.index): r.cause for r in gaps.itertuples()}
    assert labels == {
        ("a", 1): "decode",
        ("a", 2): "prefill_in_step",
        ("a", 3): "decode",
        ("b", 1): "decode",
        ("b", 2): "preemption",
        ("c", 1): "decode",
        ("c", 2): "preemption",  # preemption wins over prefill
        ("d", 1): "unknown",
    }
    by_key = gaps.set_index(["request_id", "index"])
    assert by_key.loc[("b", 2), "gap_s"] == pytest.approx(0.24)
    assert by_key.loc[("b", 2), "prev_step"] == 4
    only_a = label_gaps(tokens, steps, request_ids=["a"])
    assert set(only_a["request_id"]) == {"a"} and len(only_a) == 3


def test_itl_by_cause_reports_p99_and_spike_shares() -> None:
    steps = steps_frame([(s, 8 if s % 10 == 0 else 0, 0) for s in range(1, 202)])
    # one request, 200 gaps: 1 ms decodes, every 10th step shares a prefill and takes 9 ms
    tokens = []
    time = 0.0
    for step in range(1, 202):
        time += 0.009 if step % 10 == 0 else 0.001
        tokens.append(("r", step - 1, step, time))
    out = itl_by_cause(tokens_frame(tokens), steps, ["r"])
    assert set(out) == {f"itl_p99_{c}_s" for c in CAUSES} | {f"itl_spike_share_{c}" for c in CAUSES}
    assert set(out) <= set(REGISTRY)
    assert out["itl_p99_decode_s"] == pytest.approx(0.001)
    assert out["itl_p99_prefill_in_step_s"] == pytest.approx(0.009)
    assert out["itl_p99_preemption_s"] is None
    assert out["itl_spike_share_prefill_in_step"] == 1.0
    assert out["itl_spike_share_decode"] == 0.0
    assert itl_by_cause(tokens_frame(tokens), steps.iloc[:0], ["r"]) == {}  # no steps: none
    assert itl_by_cause(tokens_frame(tokens), steps, ["other"]) == {}


def test_engine_reports_detokenize_time() -> None:
    llm = LLM(model="tiny", dtype="float32", max_model_len=128)
    engine = llm.engine
    engine.add_request("text", [10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request(
        "ids", [10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)
    )
    finished: dict[str, Finished] = {}
    while engine.has_unfinished_requests():
        finished.update({e.request_id: e for e in engine.step() if isinstance(e, Finished)})
    assert finished["text"].detokenize_ns > 0
    assert finished["ids"].detokenize_ns == 0
    assert not engine.output.detokenize_ns  # nothing left behind


TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x kv_heads x head_dim x fp32, K and V


@pytest.fixture(scope="module")
def preempting_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pd.DataFrame]:
    """Chunked prefill (16-token budget) and a 40-block pool of 4 tokens: long prompts are
    split, and decodes that outgrow the pool preempt and recompute."""
    config = EngineConfig(
        model="tiny",
        dtype="float32",
        kv_cache="paged",
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=40 * 4 * TINY_BYTES_PER_TOKEN,
    )
    backend = BuiltinBackend(config)
    backend.load()
    prompts = [
        list(range(100, 151)),
        list(range(200, 237)),
        list(range(300, 368)),
        [11, 12, 13],
        list(range(400, 470)),
    ]
    max_tokens = [12, 5, 20, 9, 16]
    workload = [
        WorkloadRequest(
            GenerationRequest(
                f"r{i}", prompt, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
            ),
            0.0,
        )
        for i, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    recorder = RunRecorder(tmp_path_factory.mktemp("phases"))
    Driver(backend, recorder.append).run(workload)
    backend.close()
    return recorder.finalize()


def test_phase_columns_of_a_real_run_add_up(preempting_run: dict[str, pd.DataFrame]) -> None:
    requests = preempting_run["requests"]
    assert (requests["status"] == "ok").all()
    phases = ["tokenize_s", "queue_s", "prefill_s", "decode_s"]
    assert (requests[[*phases, "detokenize_s"]] >= 0).all().all()
    total = (requests["sent_s"] - requests["arrival_s"]) + requests[phases].sum(axis=1)
    e2e = requests["last_token_s"] - requests["arrival_s"]
    assert (total - e2e).abs().max() < 1e-9
    assert (requests["detokenize_s"] > 0).all()
    # detokenizing happens inside the steps that produced the tokens
    assert (requests["detokenize_s"] < requests["prefill_s"] + requests["decode_s"]).all()
    # chunks: at least ceil(prompt / 16) each; recomputation adds prefill tokens
    minimum_chunks = requests["prompt_tokens"].map(lambda n: math.ceil(n / 16))
    assert (requests["num_prefill_chunks"] >= minimum_chunks).all()
    assert (requests["num_prefill_chunks"] > 1).any()
    preempted = requests["num_preemptions"] > 0
    assert preempted.any(), "the pool was meant to force preemption"
    assert (
        requests.loc[preempted, "prefill_tokens_computed"]
        > requests.loc[preempted, "prompt_tokens"]
    ).all()
    assert (
        requests.loc[~preempted, "prefill_tokens_computed"]
        == requests.loc[~preempted, "prompt_tokens"]
    ).all()
    assert (
        requests["prefill_tokens_computed"].sum() == preempting_run["steps"]["prefill_tokens"].sum()
    )


def test_gap_labels_of_a_real_run(preempting_run: dict[str, pd.DataFrame]) -> None:
    requests, tokens, steps = (preempting_run[t] for t in ("requests", "tokens", "steps"))
    gaps = label_gaps(tokens, steps, requests["request_id"])
    assert len(gaps) == (requests["output_tokens"] - 1).sum()
    assert set(gaps["cause"]) <= set(CAUSES)
    # a preempted request waits out of the batch and is recomputed: a preemption gap
    preempted_ids = set(requests.loc[requests["num_preemptions"] > 0, "request_id"])
    labelled = set(gaps.loc[gaps["cause"] == "preemption", "request_id"])
    assert preempted_ids <= labelled
    # a decode gap ends at a step with no prefill and no preemption
    step_of = steps.set_index("step")
    decode = gaps[gaps["cause"] == "decode"]
    assert len(decode)
    assert (step_of.loc[decode["step"], "prefill_tokens"] == 0).all()
    assert (step_of.loc[decode["step"], "num_preempted"] == 0).all()
    summary = compute_summary(requests, tokens, steps)
    shares = [summary[f"itl_spike_share_{c}"] for c in CAUSES]
    assert sum(shares) == pytest.approx(1.0)
