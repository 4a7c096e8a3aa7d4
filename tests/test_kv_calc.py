"""kv-calc reproduces the seeds' memory arithmetic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.kv_calc import GIB, kv_calc

REPO = Path(__file__).resolve().parents[1]


def test_llama3_8b_holds_one_gib_per_8k_sequence() -> None:
    r = kv_calc("llama3-8b", None, 8192, "fp16", 80, gpu_memory_utilization=1.0)
    assert r["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072
    assert r["kv_bytes_per_sequence"] == GIB
    assert 15.9e9 < r["weight_bytes"] < 16.2e9  # ~8.03B parameters in fp16
    assert r["max_sequences"] == (80 * GIB - r["weight_bytes"]) // GIB == 65
    assert r["gqa_saving"] == 4


def test_gqa_and_dtype_scale_kv_bytes() -> None:
    mha = kv_calc("small", None, 1024, "fp32", 16)
    mqa = kv_calc("small", {"num_kv_heads": 1}, 1024, "fp32", 16)
    half = kv_calc("small", None, 1024, "bf16", 16)
    assert mha["kv_bytes_per_token"] == 12 * mqa["kv_bytes_per_token"]
    assert mha["kv_bytes_per_token"] == 2 * half["kv_bytes_per_token"]


def test_cli_prints_the_report() -> None:
    out = subprocess.run([sys.executable, "-m", "harness.cli", "kv-calc", "model=llama3-8b",
                          "engine.max_model_len=8192", "engine.dtype=fp16",
                          "device_memory_gib=80"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "131,072 B" in out.stdout and "1.00 GiB" in out.stdout
    assert "sequences that fit     57" in out.stdout  # 0.9 x 80 GiB - weights
