"""The roofline: per-step counts from the engine, FLOPs and bytes against the formulas, MBU/MFU
and the run metrics, and a tiny run that carries it all into steps.parquet and summary.json."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from engines.base import StepRecord
from engines.builtin import LLM, SamplingParams
from engines.builtin.step_stats import layer_mean_counts, roofline_counts
from harness.measuring.roofline import (
    ROOFLINE_COLUMNS,
    ModelShape,
    add_roofline,
    annotate_run,
    attainable_flops,
    predicted_time,
    roofline_summary,
    step_costs,
)
from harness.run_folder import STEP_COLUMNS
from harness.running.experiment import run_experiment

# A hand-computable shape: every constant small and distinct.
SHAPE = ModelShape(
    block_linear_params=100,
    lm_head_params=50,
    attention_flops_per_pair=8,
    block_linear_bytes=400,
    lm_head_bytes=200,
    kv_bytes_per_token=16,
    dtype="float32",
)


def steps_frame(*rows: dict) -> pd.DataFrame:
    base = {
        "start_s": 0.0,
        "end_s": 1.0,
        "num_prefill_seqs": 0,
        "num_decode_seqs": 0,
        "prefill_tokens": 0,
        "decode_tokens": 0,
        "padding_tokens": 0,
        "logits_tokens": 0,
        "attention_pairs": 0,
        "kv_tokens_read": 0,
        "kv_tokens_written": 0,
    }
    return pd.DataFrame([{**base, **row} for row in rows])


# ---- the counts the engine records ---------------------------------------------------------


def brute_force_counts(
    rows: list[tuple[int, int, int]], window: int | None, retains: bool
) -> dict[str, int]:
    pairs = read = written = 0
    for start, queries, real in rows:
        for position in range(start, start + queries):
            keys = range(0, position + 1)
            pairs += sum(1 for j in keys if window is None or position - j < window)
        cached = {
            j
            for p in range(start, start + queries)
            for j in range(start)
            if window is None or p - j < window
        }
        read += len(cached) if retains else 0
        written += real if retains else 0
    return {"attention_pairs": pairs, "kv_tokens_read": read, "kv_tokens_written": written}


@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("retains", [True, False])
def test_roofline_counts_match_brute_force(window: int | None, retains: bool) -> None:
    # (tokens computed before, new real tokens, padding tokens) per scheduled row
    scheduled = [(0, 5, 0), (7, 1, 0), (12, 4, 2), (3, 1, 0), (0, 1, 0)]
    padding_rows = [(9, 1), (0, 3)]  # static batching: (start, tokens), nothing stored
    plan = SimpleNamespace(
        scheduled=[
            SimpleNamespace(num_computed_before=c, num_new_tokens=n, num_padding_tokens=p)
            for c, n, p in scheduled
        ],
        padding_rows=[SimpleNamespace(start=s, num_tokens=n) for s, n in padding_rows],
    )
    rows = [(c, n + p, n) for c, n, p in scheduled] + [(s, n, 0) for s, n in padding_rows]
    assert roofline_counts(plan, window, retains) == brute_force_counts(rows, window, retains)
    # three layers within the window and one global: the mean of a token of every layer
    mixed = layer_mean_counts(plan, Counter((window, None, window, window)), retains)
    windowed, full = (brute_force_counts(rows, w, retains) for w in (window, None))
    assert mixed == {k: round((3 * windowed[k] + full[k]) / 4) for k in full}


def record_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[StepRecord]:
    records: list[StepRecord] = []
    llm.engine.step_observers.append(records.append)
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return records


def test_engine_records_the_counts(make_tiny: Callable[..., LLM]) -> None:
    records = record_steps(make_tiny(), [list(range(10, 15)), list(range(20, 27))], 3)
    prefill, decode = records[0], records[1]
    assert (prefill.prefill_tokens, prefill.logits_tokens) == (12, 2)
    assert prefill.attention_pairs == 5 * 6 // 2 + 7 * 8 // 2  # causal over each prompt
    assert (prefill.kv_tokens_read, prefill.kv_tokens_written) == (0, 12)
    assert (decode.decode_tokens, decode.logits_tokens) == (2, 2)
    assert decode.attention_pairs == 6 + 8  # each new token sees its whole context
    assert (decode.kv_tokens_read, decode.kv_tokens_written) == (5 + 7, 2)


def test_sliding_window_and_no_cache_counts(make_tiny: Callable[..., LLM]) -> None:
    windowed = make_tiny(model_overrides={"sliding_window": 4})
    decode = record_steps(windowed, [list(range(10, 15)), list(range(20, 27))], 2)[1]
    assert decode.attention_pairs == 4 + 4
    assert decode.kv_tokens_read == 3 + 3  # the keys before the new token inside the window

    second = record_steps(make_tiny(kv_cache="none"), [list(range(10, 15))], 2)[1]
    # no cache: the step recomputes all 6 tokens, reads and stores nothing
    assert (second.prefill_tokens, second.attention_pairs) == (6, 6 * 7 // 2)
    assert (second.kv_tokens_read, second.kv_tokens_written, second.logits_tokens) == (0, 0, 1)


def test_chunked_middle_chunk_computes_no_logits(make_tiny: Callable[..., LLM]) -> None:
    llm = make_tiny(enable_chunked_prefill=True, max_num_batched_tokens=16, kv_cache="paged")
    records = record_steps(llm, [list(range(10, 50))], 1)  # 40 tokens: chunks 16, 16, 8
    assert [r.prefill_tokens for r in records] == [16, 16, 8]
    assert [r.logits_tokens for r in records] == [0, 0, 1]
    assert [r.kv_tokens_read for r in records] == [0, 16, 32]
    shape = ModelShape.from_engine_info(llm.engine.describe())
    assert shape is not None
    costs = step_costs(pd.DataFrame([asdict(r) for r in records]), shape)
    head = llm.engine.describe()["lm_head_bytes"]
    blocks = llm.engine.describe()["linear_weight_bytes"]
    assert costs["weight_bytes_read"].tolist() == [blocks, blocks, blocks + head]


# ---- FLOPs and bytes -----------------------------------------------------------------------


def test_costs_follow_the_formula() -> None:
    steps = steps_frame(
        # a decode step of 2 sequences
        {
            "num_decode_seqs": 2,
            "decode_tokens": 2,
            "logits_tokens": 2,
            "attention_pairs": 10,
            "kv_tokens_read": 8,
            "kv_tokens_written": 2,
        },
        # a middle prefill chunk: no logits, so no LM head FLOPs or bytes
        {
            "num_prefill_seqs": 1,
            "prefill_tokens": 4,
            "attention_pairs": 26,
            "kv_tokens_read": 4,
            "kv_tokens_written": 4,
        },
        # static batching: 1 real decode + 1 padding decode; padding is computed
        {
            "num_decode_seqs": 1,
            "decode_tokens": 1,
            "padding_tokens": 1,
            "logits_tokens": 1,
            "attention_pairs": 6,
            "kv_tokens_read": 5,
            "kv_tokens_written": 1,
        },
    )
    costs = step_costs(steps, SHAPE)
    assert costs["flops"].tolist() == [
        2 * 100 * 2 + 2 * 50 * 2 + 8 * 10,
        2 * 100 * 4 + 8 * 26,
        2 * 100 * 2 + 2 * 50 * 1 + 8 * 6,
    ]
    assert costs["weight_bytes_read"].tolist() == [400 + 200, 400, 400 + 200]
    assert costs["kv_bytes_read"].tolist() == [8 * 16, 4 * 16, 5 * 16]
    assert costs["kv_bytes_written"].tolist() == [2 * 16, 4 * 16, 1 * 16]


def test_lora_rows_and_adapters_add_their_flops_and_bytes() -> None:
    """Each adapter row's shrink and expand (2 x the adapter's parameters) and each adapter
    the step runs, read once; a step without adapters costs what it did."""
    shape = dataclasses.replace(SHAPE, lora_params_per_adapter=30.0, lora_bytes_per_param=2)
    steps = steps_frame(
        {"num_decode_seqs": 3, "decode_tokens": 3, "logits_tokens": 3, "attention_pairs": 6,
         "kv_tokens_read": 3, "kv_tokens_written": 3, "lora_adapters": 2, "lora_rows": 2},
        {"num_decode_seqs": 1, "decode_tokens": 1, "logits_tokens": 1, "attention_pairs": 2,
         "kv_tokens_read": 1, "kv_tokens_written": 1, "lora_adapters": 0, "lora_rows": 0},
    )  # fmt: skip
    costs = step_costs(steps, shape)
    plain = step_costs(steps, SHAPE)
    assert (costs["flops"] - plain["flops"]).tolist() == [2 * 30 * 2, 0]
    assert (costs["weight_bytes_read"] - plain["weight_bytes_read"]).tolist() == [30 * 2 * 2, 0]


def test_experts_add_their_pairs_flops_and_the_touched_experts_bytes() -> None:
    """A mixture-of-experts step: 2 x an expert's parameters per (token, expert) pair, and each
    (layer, expert) pair it touched read once; a dense step costs what it did."""
    shape = dataclasses.replace(SHAPE, moe_expert_params=20.0, moe_expert_bytes=80.0)
    steps = steps_frame(
        {"num_decode_seqs": 2, "decode_tokens": 2, "logits_tokens": 2, "attention_pairs": 4,
         "kv_tokens_read": 2, "kv_tokens_written": 2, "moe_expert_tokens": [3, 0, 1, 0],
         "moe_experts_touched": 3},
        {"num_decode_seqs": 1, "decode_tokens": 1, "logits_tokens": 1, "attention_pairs": 2,
         "kv_tokens_read": 1, "kv_tokens_written": 1, "moe_expert_tokens": None,
         "moe_experts_touched": 0},
    )  # fmt: skip
    costs, plain = step_costs(steps, shape), step_costs(steps, SHAPE)
    assert (costs["flops"] - plain["flops"]).tolist() == [2 * 20 * 4, 0]
    assert (costs["weight_bytes_read"] - plain["weight_bytes_read"]).tolist() == [80 * 3, 0]


def test_an_moe_engine_describes_its_experts_apart() -> None:
    llm = LLM(model="tiny-moe", dtype="float32", max_model_len=128)
    facts = llm.engine.describe()
    cfg, shape = llm.engine.model_config, facts["roofline_shape"]
    experts = cfg.num_layers * cfg.num_experts  # every layer of tiny-moe is an MoE layer
    assert shape["moe_expert_params"] == 3 * cfg.hidden_size * cfg.expert_intermediate_size
    assert shape["moe_all_expert_bytes"] == experts * shape["moe_expert_bytes"]
    linear = sum(
        m.in_features * m.out_features
        for name, m in llm.engine.runner.model.linear_layers().items()
        if name.startswith("layers.")
    )
    assert shape["block_linear_params"] + experts * shape["moe_expert_params"] == linear
    model = ModelShape.from_engine_info(facts)
    assert model is not None
    assert model.block_linear_bytes == facts["linear_weight_bytes"] - shape["moe_all_expert_bytes"]


def test_mbu_mfu_and_prediction() -> None:
    steps = steps_frame(
        {
            "num_decode_seqs": 2,
            "decode_tokens": 2,
            "logits_tokens": 2,
            "attention_pairs": 10,
            "kv_tokens_read": 8,
            "kv_tokens_written": 2,
            "start_s": 1.0,
            "end_s": 3.0,
        },
    )
    out = add_roofline(steps, SHAPE, peak_flops=100.0, memory_bandwidth=1000.0)
    flops, moved = 680.0, 600 + 128 + 32
    row = out.iloc[0]
    assert row["predicted_s"] == pytest.approx(max(flops / 100.0, moved / 1000.0))  # compute
    assert row["mbu"] == pytest.approx(moved / 2.0 / 1000.0)
    assert row["mfu"] == pytest.approx(flops / 2.0 / 100.0)
    memory_bound = add_roofline(steps, SHAPE, peak_flops=1e6, memory_bandwidth=1000.0)
    assert memory_bound.iloc[0]["predicted_s"] == pytest.approx(moved / 1000.0)
    # a machine that overlaps nothing takes the sum; half overlap hides half the shorter part
    serial = add_roofline(steps, SHAPE, peak_flops=100.0, memory_bandwidth=1000.0, overlap=0.0)
    assert serial.iloc[0]["predicted_s"] == pytest.approx(flops / 100.0 + moved / 1000.0)
    half = add_roofline(steps, SHAPE, peak_flops=100.0, memory_bandwidth=1000.0, overlap=0.5)
    assert half.iloc[0]["predicted_s"] == pytest.approx(flops / 100.0 + 0.5 * moved / 1000.0)
    no_peak = add_roofline(steps, SHAPE, peak_flops=None, memory_bandwidth=1000.0)
    assert np.isnan(no_peak.iloc[0]["mfu"]) and np.isnan(no_peak.iloc[0]["predicted_s"])
    assert no_peak.iloc[0]["mbu"] == pytest.approx(row["mbu"])


def test_engine_shape_counts_blocks_and_head_not_the_embedding(
    make_tiny: Callable[..., LLM],
) -> None:
    engine = make_tiny().engine
    info, cfg = engine.describe(), engine.model_config
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h
    shape = ModelShape.from_engine_info(info)
    assert shape is not None
    assert shape.block_linear_params == cfg.num_layers * per_layer
    assert shape.lm_head_params == h * cfg.vocab_size
    assert shape.attention_flops_per_pair == 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    assert shape.block_linear_bytes == 4 * shape.block_linear_params  # fp32, no biases
    assert shape.lm_head_bytes == 4 * h * cfg.vocab_size
    decode = steps_frame({"num_decode_seqs": 1, "decode_tokens": 1, "logits_tokens": 1})
    read = step_costs(decode, shape)["weight_bytes_read"].iloc[0]
    assert read == shape.block_linear_bytes + shape.lm_head_bytes
    assert read == info["weight_bytes"] - info["embedding_bytes"] - 4 * h * (
        2 * cfg.num_layers + 1
    )  # norms

    tied = ModelShape.from_engine_info(
        make_tiny(model_overrides={"tie_word_embeddings": True}).engine.describe()
    )
    assert tied is not None
    # a tied head reads the embedding table in full, once, as the LM head
    assert tied.lm_head_bytes == info["embedding_bytes"]
    assert tied.block_linear_bytes == shape.block_linear_bytes


def test_quantized_weights_count_quantized_bytes(make_tiny: Callable[..., LLM]) -> None:
    llm = make_tiny(quantization="int8")
    cfg = llm.engine.model_config
    shape = ModelShape.from_engine_info(llm.engine.describe())
    assert shape is not None
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    params = cfg.num_layers * (h * (q + 2 * kv) + q * h + 2 * h * i + i * h)
    output_rows = cfg.num_layers * ((q + 2 * kv) + h + 2 * i + h)
    # one byte per weight plus one fp32 scale per output row; the head too (quantized layers
    # take an INT8 head by default, issue 36), and dense fp32 when asked
    assert shape.block_linear_bytes == params + 4 * output_rows
    assert shape.block_linear_params == params  # FLOPs do not shrink with storage
    assert shape.lm_head_bytes == h * cfg.vocab_size + 4 * cfg.vocab_size
    dense_head = make_tiny(quantization="int8", quantize_lm_head=False).engine.describe()
    dense = ModelShape.from_engine_info(dense_head)
    assert dense is not None and dense.lm_head_bytes == 4 * h * cfg.vocab_size


# ---- run metrics ---------------------------------------------------------------------------


def test_summary_on_a_synthetic_frame() -> None:
    steps = steps_frame(
        {"num_prefill_seqs": 2, "prefill_tokens": 20},
        {"num_decode_seqs": 2, "decode_tokens": 2},
        {"num_decode_seqs": 2, "decode_tokens": 2, "end_s": 2.0},
        {"num_decode_seqs": 2, "decode_tokens": 2, "end_s": 4.0},
        {"num_prefill_seqs": 1, "num_decode_seqs": 1, "prefill_tokens": 5, "decode_tokens": 1},
    )
    steps["mbu"] = [0.1, 0.2, 0.4, 0.6, 0.5]
    steps["mfu"] = [0.8, 0.01, 0.02, 0.03, 0.3]
    steps["predicted_s"] = [0.5, 0.5, 0.5, 1.0, 2.0]
    out = roofline_summary(steps)
    assert out["mbu_decode_mean"] == pytest.approx(0.4)
    assert out["mbu_mean"] == pytest.approx(0.36)
    assert out["mfu_prefill_mean"] == pytest.approx(0.8)
    assert out["mfu_mean"] == pytest.approx(0.232)
    # measured / predicted: decodes 1/0.5, 2/0.5, 4/1.0 -> 2, 4, 4
    assert out["roofline_decode_ratio_p50"] == pytest.approx(4.0)
    assert out["roofline_ratio_p50"] == pytest.approx(2.0)  # 2, 2, 4, 4, 0.5
    # time-weighted over measured 1, 1, 2, 4, 1 s: the long steps count for more
    assert out["mfu_overall"] == pytest.approx((0.8 + 0.01 + 0.04 + 0.12 + 0.3) / 9)
    assert out["roofline_fraction"] == pytest.approx(4.5 / 9)
    steps["mbu"] = np.nan
    assert roofline_summary(steps) == {}


def test_annotate_without_a_spec_leaves_nan(tmp_path: Path) -> None:
    steps = steps_frame({"num_decode_seqs": 1, "decode_tokens": 1, "logits_tokens": 1})
    for column in ROOFLINE_COLUMNS:
        steps[column] = np.nan
    info = {"engine": {"roofline_shape": {}}, "hardware": {"name": None, "note": "remote"}}
    out = annotate_run(tmp_path, steps, info)
    assert out[list(ROOFLINE_COLUMNS)].isna().all().all()
    assert not (tmp_path / "steps.parquet").exists()


# ---- end to end ----------------------------------------------------------------------------


def tiny_run_config(hardware: dict) -> dict:
    return {
        "engine": {
            "backend": "builtin",
            "dtype": "float32",
            "device": "cpu",
            "max_model_len": 128,
            "max_num_seqs": 4,
        },
        "model": {"name": "tiny"},
        "workload": {"type": "synthetic", "num_requests": 4, "input_len": 12, "output_len": 5},
        "hardware": hardware,
        "run": {"warmup_requests": 0},
    }


def test_tiny_run_writes_columns_and_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERLAB_CACHE_DIR", str(tmp_path / "cache"))
    config = tiny_run_config({"name": "cpu", "probe_bytes": 1 << 20, "matmul_size": 64})
    summary = run_experiment(config, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary["error"]
    assert summary["hardware"]["name"] == "cpu"
    assert (tmp_path / "cache" / "hardware").is_dir()  # the probe was cached
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    assert set(ROOFLINE_COLUMNS) <= set(STEP_COLUMNS) <= set(steps.columns)
    assert steps[list(ROOFLINE_COLUMNS)].notna().all().all()
    assert (steps[["flops", "weight_bytes_read", "predicted_s", "mbu", "mfu"]] > 0).all().all()
    # the rewritten parquet holds exactly the formula on the recorded counts
    shape = ModelShape.from_engine_info(summary["engine"])
    assert shape is not None
    hardware = summary["hardware"]
    expected = add_roofline(
        steps,
        shape,
        hardware["peak_flops"]["float32"],
        hardware["memory_bandwidth"],
        hardware["overlap"]["float32"],
    )
    pd.testing.assert_frame_equal(steps, expected)
    first_decode = steps[steps["num_decode_seqs"] == 4].iloc[0]
    assert first_decode["kv_tokens_read"] == 4 * 12
    metrics = summary["metrics"]
    for name in (
        "mbu_decode_mean",
        "mfu_prefill_mean",
        "mfu_mean",
        "mbu_mean",
        "roofline_decode_ratio_p50",
        "roofline_ratio_p50",
        "mfu_overall",
        "roofline_fraction",
    ):
        assert metrics[name] > 0, name


def test_unknown_hardware_fails_the_run_by_name(tmp_path: Path) -> None:
    summary = run_experiment(tiny_run_config({"name": "tpu-v5"}), tmp_path / "run", progress=False)
    assert summary["status"] == "failed"
    assert "hardware: 'tpu-v5' is invalid; allowed: a100|auto|cpu|h100|h200|l4" in summary["error"]


def test_attainable_flops_is_the_roofline_curve_predicted_s_follows() -> None:
    peak, bandwidth = 100e9, 10e9  # ridge at 10 FLOP/byte
    intensity = np.array([1.0, 10.0, 1000.0])
    # overlap 1: the standard min(peak, bandwidth x intensity)
    np.testing.assert_allclose(attainable_flops(intensity, peak, bandwidth), [10e9, 100e9, 100e9])
    # overlap 0: compute and memory time add; at the ridge each takes half: half the peak
    np.testing.assert_allclose(
        attainable_flops(intensity, peak, bandwidth, 0.0),
        [1 / (0.01e-9 + 0.1e-9), 50e9, 1000 / (10e-9 + 0.1e-9)],
    )
    # the same formula as a step's predicted_s
    assert predicted_time(2.0, 3.0, 0.25) == 3.0 + 0.75 * 2.0


def test_verifying_steps_are_summarized_apart_from_prefills() -> None:
    """A step that verified drafts counts its tokens as prefill tokens; it must not enter the
    prefill-only means, and gets its own MBU, ratio and FLOPs per byte."""
    steps = steps_frame(
        {"num_prefill_seqs": 1, "prefill_tokens": 20},
        {"num_decode_seqs": 1, "decode_tokens": 1},
        {"num_prefill_seqs": 1, "prefill_tokens": 5, "spec_draft_tokens": 4},
    )
    steps["spec_draft_tokens"] = steps["spec_draft_tokens"].fillna(0)
    steps["mbu"] = [0.2, 0.5, 0.6]
    steps["mfu"] = [0.9, 0.01, 0.05]
    steps["predicted_s"] = [0.5, 0.5, 0.25]
    steps["flops"] = [40e9, 2e9, 10e9]
    steps["weight_bytes_read"] = [1e9, 1e9, 1e9]
    steps["kv_bytes_read"] = [0.0, 0.0, 0.0]
    steps["kv_bytes_written"] = [0.0, 0.0, 0.0]
    out = roofline_summary(steps)
    assert out["mfu_prefill_mean"] == pytest.approx(0.9)  # the verifying step left out
    assert out["mbu_verify_mean"] == pytest.approx(0.6)
    assert out["roofline_verify_ratio_p50"] == pytest.approx(4.0)  # 1 s measured / 0.25
    assert out["flops_per_byte_verify_mean"] == pytest.approx(10.0)
    assert out["flops_per_byte_decode_mean"] == pytest.approx(2.0)


# ---- tensor parallelism: the link ------------------------------------------------------------

TP_SHAPE = ModelShape(
    **{
        **asdict(SHAPE),
        "tensor_parallel_size": 2,
        "allreduces_per_step": 5,
        "hidden_bytes_per_token": 256,
        "logits_bytes_per_row": 1000,
    }
)


def test_a_tensor_parallel_step_adds_its_collectives_on_the_link() -> None:
    steps = steps_frame(
        {"prefill_tokens": 3, "logits_tokens": 1, "num_prefill_seqs": 1},
        {"decode_tokens": 2, "logits_tokens": 2, "num_decode_seqs": 2},
        {},  # nothing computed: nothing moves
    )
    bandwidth, latency = 1e8, 1e-5
    out = add_roofline(steps, TP_SHAPE, 1e9, 1e9, 1.0, (bandwidth, latency))
    base = add_roofline(steps, SHAPE, 1e9, 1e9, 1.0)
    # N = 2: an all-reduce moves its message once (2(N-1)/N) in 2 hops, a gather half the
    # assembled rows in 1 hop
    expected = [
        5 * (3 * 256 / bandwidth + 2 * latency) + (0.5 * 1000 / bandwidth + latency),
        5 * (2 * 256 / bandwidth + 2 * latency) + (0.5 * 2000 / bandwidth + latency),
        0.0,
    ]
    np.testing.assert_allclose(out["predicted_comm_s"], expected)
    np.testing.assert_allclose(out["predicted_s"], base["predicted_s"] + expected)
    assert (base["predicted_comm_s"] == 0).all()  # one rank: nothing to add
    # without the link's figures the prediction of a tensor-parallel step is unknown
    unlinked = add_roofline(steps, TP_SHAPE, 1e9, 1e9, 1.0, None)
    assert unlinked["predicted_s"].isna().all() and unlinked["mbu"].notna().any()
