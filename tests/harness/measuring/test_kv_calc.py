"""kv-calc reproduces the seeds' memory arithmetic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

import configs
import engines.registry  # noqa: F401  (the engine groups' schemas, for compose)
from engines.builtin import platform
from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache.storage import kv_element_bytes
from harness.measuring.kv_calc import GIB, kv_calc
from models.config import kv_bytes_per_token, resolve_model

REPO = Path(__file__).resolve().parents[3]


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


@pytest.mark.slow
def test_cli_prints_the_report() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "kv-calc",
            "model=llama3-8b",
            "engine.max_model_len=8192",
            "engine.dtype=fp16",
            "device_memory_gib=80",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "131,072 B" in out.stdout and "1.00 GiB" in out.stdout
    assert "sequences that fit     57" in out.stdout  # 0.9 x 80 GiB - weights


# ---- the engine's default KV budget on CPU (engines/builtin/platform.py) ---------------------

GB = 10**9


def fake_memory(
    monkeypatch: pytest.MonkeyPatch, available: int, free: int, total: int = 32 * GB
) -> None:
    """psutil reports `available` (free + reclaimable page cache) and `free` pages; no cgroup."""
    monkeypatch.setattr(
        platform.psutil,
        "virtual_memory",
        lambda: SimpleNamespace(total=total, available=available, free=free),
    )
    monkeypatch.setattr(platform, "cgroup_memory_headroom", lambda: None)


def default_experiment_engine() -> EngineConfig:
    """The engine config `inferlab run` builds with no overrides (model=small)."""
    cfg = OmegaConf.to_container(configs.compose([]), resolve=True)
    engine = dict(cfg["engine"])  # type: ignore[index]
    engine.pop("backend")
    return EngineConfig.from_dict({**engine, "model": cfg["model"]["name"]})  # type: ignore[index]


def test_the_default_experiment_fits_a_machine_with_4_gb_available(monkeypatch) -> None:
    """The reported failure: 16.5 GB available but little free (page cache), and the budget
    came from free pages. With 4 GB available, 1.6 GB of it free, the default run (the small
    model, max_model_len 2048) must still hold a sequence; its weights (and the packed copy
    the C kernels' GEMM keeps) are taken off what is available first, as they load first."""
    config = default_experiment_engine()
    assert config.model == "small"
    model = resolve_model(config.model, config.model_overrides)
    max_model_len = config.max_model_len or model.max_position_embeddings
    assert max_model_len == 2048
    per_token = round(
        kv_bytes_per_token(
            model, kv_element_bytes(torch.float32, model.head_dim, config.kv_cache_dtype)
        )
    )
    one_sequence = max_model_len * per_token
    weights = 2 * model.num_parameters() * 4  # fp32, plus the packed copy (an upper bound)
    fake_memory(monkeypatch, available=4 * GB - weights, free=int(1.6 * GB) - weights)
    budget, reason = platform.Platform(torch.device("cpu")).kv_budget(
        config.kv_cache_memory_bytes, weights, config.gpu_memory_utilization, one_sequence
    )
    assert budget // one_sequence >= 1, (budget, one_sequence, reason)
    assert budget == int(0.25 * (4 * GB - weights))
    assert reason.startswith(
        f"min(4 GiB, 0.25 x {(4 * GB - weights) / 2**30:.2f} GiB available (psutil available"
    )


def test_budget_is_a_quarter_of_available_up_to_4_gib(monkeypatch) -> None:
    fake_memory(monkeypatch, available=8 * GB, free=GB // 10)
    assert platform.cpu_kv_budget(8 * GB, 1)[0] == 2 * GB
    assert platform.cpu_kv_budget(40 * GB, 1)[0] == 4 << 30


def test_budget_is_raised_to_one_sequence_when_half_of_available_holds_it(monkeypatch) -> None:
    fake_memory(monkeypatch, available=GB, free=GB)
    budget, reason = platform.cpu_kv_budget(GB, 400 * 10**6)  # a quarter would hold none
    assert budget == 400 * 10**6 and "raised to one sequence of max_model_len" in reason
    budget, reason = platform.cpu_kv_budget(GB, 600 * 10**6)  # more than half: not raised
    assert budget == GB // 4 and "raised" not in reason


def test_a_cgroup_limit_below_available_sets_the_budget(monkeypatch) -> None:
    fake_memory(monkeypatch, available=30 * GB, free=30 * GB)
    monkeypatch.setattr(platform, "cgroup_memory_headroom", lambda: 2 * GB)
    budget, reason = platform.cpu_kv_budget(30 * GB, 1)
    assert budget == GB // 2 and "cgroup memory limit headroom" in reason


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_headroom_counts_reclaimable_cache_as_free(
    version: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(platform.psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * GB))
    if version == "v2":
        (tmp_path / "memory.max").write_text(f"{8 * GB}\n")
        (tmp_path / "memory.current").write_text(f"{5 * GB}\n")
        (tmp_path / "memory.stat").write_text(f"anon {3 * GB}\ninactive_file {GB}\n")
    else:
        (tmp_path / "memory").mkdir()
        (tmp_path / "memory/memory.limit_in_bytes").write_text(f"{8 * GB}\n")
        (tmp_path / "memory/memory.usage_in_bytes").write_text(f"{5 * GB}\n")
        (tmp_path / "memory/memory.stat").write_text(f"cache {2 * GB}\ntotal_inactive_file {GB}\n")
    assert platform.cgroup_memory_headroom(tmp_path) == 4 * GB
    (tmp_path / ("memory.max" if version == "v2" else "memory/memory.limit_in_bytes")).write_text(
        "max\n" if version == "v2" else "9223372036854771712\n"
    )  # how each says "no limit"
    assert platform.cgroup_memory_headroom(tmp_path) is None
    assert platform.cgroup_memory_headroom(tmp_path / "absent") is None
