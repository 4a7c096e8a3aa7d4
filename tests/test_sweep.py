"""sweep.csv post-processing: the KV speed-up curve and the saturation rate."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.sweep import kv_speedup_curve, saturation_rate


def test_kv_speedup_curve_per_context_length() -> None:
    frame = pd.DataFrame({
        "engine.kv_cache": ["none", "contiguous", "none", "contiguous"],
        "workload.input_len": [32, 32, 128, 128],
        "tpot_p50_s": [0.04, 0.02, 0.16, 0.02],
        "status": ["complete"] * 4,
    })
    curve = kv_speedup_curve(frame)
    assert curve is not None
    assert curve["context_len"].tolist() == [32, 128]
    assert curve["speedup_contiguous"].tolist() == pytest.approx([2.0, 8.0])


def test_kv_speedup_curve_skips_swept_length_ranges() -> None:
    # a [low, high] range is a distribution, not a context length: no curve, no crash
    frame = pd.DataFrame({
        "engine.kv_cache": ["none", "contiguous"],
        "workload.input_len": [[8, 24], [8, 24]],
        "tpot_p50_s": [0.04, 0.02],
        "status": ["complete"] * 2,
    })
    assert kv_speedup_curve(frame) is None


def test_saturation_rate_is_the_highest_rate_still_served() -> None:
    frame = pd.DataFrame({"offered_req_per_s": [1.0, 2.0, 4.0, 8.0],
                          "req_per_s": [1.0, 1.95, 3.0, 3.1]})
    assert saturation_rate(frame) == 2.0
