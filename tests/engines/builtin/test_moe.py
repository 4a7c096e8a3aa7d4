"""The mixture-of-experts layer's step statistics (engines/builtin/moe.py; its numbers against
transformers: tests/engines/hf/test_hf_parity.py): each step reports the (token, expert) pairs
routed to each expert over the MoE layers, and the run's summary their imbalance and entropy."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch

from engines.base import StepRecord
from engines.builtin import LLM, SamplingParams, native
from engines.builtin.moe import MoE
from harness.measuring.metrics import expert_imbalance, moe_summary


def test_every_step_counts_each_token_once_per_layer_and_chosen_expert() -> None:
    llm = LLM(model="tiny-moe", dtype="float32", max_model_len=128)
    cfg = llm.engine.model_config
    records: list[StepRecord] = []
    llm.engine.step_observers.append(records.append)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9], [11, 12], [40, 41, 42]], params)
    assert records
    for record in records:
        tokens = record.prefill_tokens + record.decode_tokens
        assert len(record.moe_expert_tokens) == cfg.num_experts == 8
        assert sum(record.moe_expert_tokens) == tokens * cfg.num_experts_per_tok * cfg.num_layers
        # the experts' MLPs ran inside the step's forward
        assert 0 < record.moe_expert_ns < record.forward_ns <= record.end_ns - record.start_ns
    dense = LLM(model="tiny", dtype="float32", max_model_len=128)
    dense_records: list[StepRecord] = []
    dense.engine.step_observers.append(dense_records.append)
    dense.generate([[5, 6, 7]], params)
    assert all(r.moe_expert_tokens == () for r in dense_records)


def test_imbalance_and_entropy() -> None:
    assert expert_imbalance([2, 2, 2, 2]) == 1.0
    assert expert_imbalance([8, 0, 0, 0]) == 4.0  # one expert of four took them all
    assert expert_imbalance(()) is None and expert_imbalance([0, 0]) is None
    steps = pd.DataFrame(
        {
            "moe_expert_tokens": [[4, 4, 0, 0], [0, 0, 4, 4], None],
            "moe_imbalance": [2.0, 2.0, None],
        }
    )
    summary = moe_summary(steps)
    assert summary["moe_routing_entropy"] == pytest.approx(1.0)  # even over the run
    assert summary["moe_imbalance_p50"] == 2.0
    assert summary["moe_expert_time_fraction"] is None  # no times given
    timed = steps.assign(start_s=[0.0, 1.0, 2.0], end_s=[1.0, 2.0, 3.0], moe_expert_s=[0.5, 1, 0])
    assert moe_summary(timed)["moe_expert_time_fraction"] == pytest.approx(1.5 / 3)
    skewed = pd.DataFrame({"moe_expert_tokens": [[9, 1]], "moe_imbalance": [1.8]})
    assert moe_summary(skewed)["moe_routing_entropy"] < 0.5
    assert moe_summary(pd.DataFrame({"moe_expert_tokens": [None]})) == {}


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_the_experts_in_one_c_call_equal_them_one_by_one(quantization: str, rows: int) -> None:
    """native.moe_experts runs the module path's kernels in its order: INT8 / INT4 experts give
    the same bits; float ones agree to float32 rounding (one row: the module path's torch GEMV
    against the engine's GEMM)."""
    assert native.load() is not None, native.reason()
    llm = LLM(
        model="tiny-moe",
        dtype="float32",
        max_model_len=128,
        quantization=quantization,
        quantization_group_size=32,
    )
    model = llm.engine.runner.model
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    moe.native = False
    one_by_one = moe(x)
    routing = list(moe.last_routing)
    moe.native = True
    assert moe._native_experts(x) is not None  # the C path does run
    grouped = moe(x)
    assert moe.last_routing == routing and sum(routing) == rows * moe.top_k
    if quantization == "none":
        torch.testing.assert_close(grouped, one_by_one, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(grouped, one_by_one)


def test_the_c_experts_follow_weights_loaded_again() -> None:
    """The C structs point into the experts' tensors: replacing a layer's weights (the
    dequantized twin does) must not leave the call reading the old ones."""
    assert native.load() is not None, native.reason()
    from dequantized_twin import dequantized_twin_tokens

    llm = LLM(model="tiny-moe", dtype="float32", max_model_len=128, quantization="int4",
              quantization_group_size=32)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    quantized = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    moe = next(layer.mlp for layer in llm.engine.runner.model.layers)
    before = moe._native
    twin = dequantized_twin_tokens(llm, prompts, params)
    assert moe._native is not before and moe._native is not None
    assert moe._native[1] is not None  # the float experts run in C too
    assert len(twin) == len(quantized) == 2


@pytest.mark.parametrize(
    ("offsets", "says"),
    [
        ([0, 2, 3, 1000, 7], "must be >= 0 and ascending"),
        ([-100000, 2, 3, 5, 7], "must be >= 0 and ascending"),
        ([0, 7, 2, 5, 7], "must be >= 0 and ascending"),
        ([0, 2, 3, 5, 9], "rows: expected a contiguous CPU torch.int64 vector of >= 9"),
    ],
)
def test_the_c_experts_refuse_offsets_that_would_read_past_their_rows(
    offsets: list[int], says: str
) -> None:
    """A bad call is a ValueError, never a crash (offsets once read past `rows`)."""
    llm = LLM(model="tiny-moe", dtype="float32", max_model_len=64)
    moe = next(layer.mlp for layer in llm.engine.runner.model.layers)
    x = torch.randn(5, llm.engine.model_config.hidden_size)
    arrays = moe._native_experts(x)
    assert arrays is not None
    gate_up, down = arrays
    experts = len(gate_up)
    bounds = torch.tensor(offsets[:4] + [offsets[4]] * (experts - 3))
    with pytest.raises(ValueError, match=re.escape(says)):
        native.moe_experts(
            gate_up, down, x, bounds, torch.arange(7) % 5, torch.rand(7), torch.zeros_like(x)
        )
    unknown = native.LINEAR_FP8 + 1  # past the last kind
    broken = native.LinearWeights(unknown, 1, None, None, None, 64, 128, 0, 0)
    with pytest.raises(ValueError, match=rf"LinearWeights\.kind: {unknown} is invalid"):
        native.moe_experts(
            (native.LinearWeights * 1)(broken), (native.LinearWeights * 1)(down[0]), x,
            torch.tensor([0, 1]), torch.tensor([0]), torch.rand(1), torch.zeros_like(x),
        )  # fmt: skip
