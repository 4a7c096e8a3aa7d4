"""The mixture-of-experts layer's step statistics (engines/builtin/moe.py; its numbers against
transformers: tests/engines/hf/test_hf_parity.py): each step reports the (token, expert) pairs
routed to each expert over the MoE layers, and the run's summary their imbalance and entropy."""

from __future__ import annotations

import pandas as pd
import pytest

from engines.base import StepRecord
from engines.builtin import LLM, SamplingParams
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
    skewed = pd.DataFrame({"moe_expert_tokens": [[9, 1]], "moe_imbalance": [1.8]})
    assert moe_summary(skewed)["moe_routing_entropy"] < 0.5
    assert moe_summary(pd.DataFrame({"moe_expert_tokens": [None]})) == {}
