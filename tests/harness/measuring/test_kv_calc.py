"""kv-calc reproduces the seeds' memory arithmetic."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import write_tiny_checkpoint
from omegaconf import OmegaConf

import configs
import engines.backends  # noqa: F401  (the engine groups' schemas, for compose)
from engines.base import ConfigError
from engines.builtin import platform
from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache.storage import kv_element_bytes
from harness.measuring import hardware
from harness.measuring.hardware import HardwareSpec
from harness.measuring.kv_calc import GIB, format_report, kv_calc
from harness.measuring.kv_calc import main as kv_calc_main
from models import train_tiny
from models.config import kv_bytes_per_token
from models.location import resolve_model

REPO = Path(__file__).resolve().parents[3]


def test_llama3_8b_holds_one_gib_per_8k_sequence() -> None:
    r = kv_calc("llama3-8b", None, 8192, "fp16", 80, gpu_memory_utilization=1.0)
    assert r["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072
    assert r["kv_bytes_per_sequence"] == GIB
    assert 15.9e9 < r["weight_bytes"] < 16.2e9  # ~8.03B parameters in fp16
    assert r["max_sequences"] == (80 * GIB - r["weight_bytes"]) // GIB == 65
    assert r["gqa_saving"] == 4


def test_kv_cache_dtype_is_planned_with_its_bytes() -> None:
    """FP8: one byte an element; INT8: one and its float16 scale per head_dim (128)."""
    bf16 = kv_calc("llama3-8b", None, 8192, "bf16", 80, gpu_memory_utilization=1.0)
    fp8 = kv_calc("llama3-8b", None, 8192, "bf16", 80, 1.0, kv_cache_dtype="fp8")
    int8 = kv_calc("llama3-8b", None, 8192, "bf16", 80, 1.0, kv_cache_dtype="int8")
    assert fp8["kv_bytes_per_token"] == bf16["kv_bytes_per_token"] / 2 == 2 * 32 * 8 * 128
    assert int8["kv_bytes_per_token"] == 2 * 32 * 8 * (128 + 2)
    assert fp8["weight_bytes"] == bf16["weight_bytes"]  # the weights stay bf16
    per_sequence = fp8["kv_bytes_per_token"] * 8192
    assert fp8["max_sequences"] == (80 * GIB - fp8["weight_bytes"]) // per_sequence == 130
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: 'fp4' is invalid; allowed: auto"):
        kv_calc("small", None, 1024, "fp32", 16, kv_cache_dtype="fp4")


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


# ---- tensor parallelism: the plan per device -------------------------------------------------

H100 = hardware.spec_from_dict(hardware.load_spec_file("h100"))


def test_llama3_70b_over_4_gpus_per_device() -> None:
    r = kv_calc("llama3-70b", None, 8192, "bf16", 80, tensor_parallel_size=4)
    # per layer and rank: q/k/v 8192 x (16 + 2 x 2) x 128, o 2048 x 8192, gate/up/down
    # 3 x 8192 x 7168; the norms whole; embedding and LM head 128256 / 4 rows of 8192
    layer = 8192 * (16 + 4) * 128 + 2048 * 8192 + 3 * 8192 * 7168
    params = 80 * layer + (80 * 2 + 1) * 8192 + 2 * 32064 * 8192
    assert r["weight_bytes_per_device"] == 2 * params == 35_278_831_616
    assert r["weight_bytes"] == 2 * 70_553_706_496  # the whole model, as before
    assert (r["heads_per_device"], r["kv_heads_per_device"], r["kv_replicas"]) == (16, 2, 1)
    assert r["kv_bytes_per_token_per_device"] == 2 * 80 * 2 * 128 * 2 == 81_920
    budget = int(80 * GIB * 0.9) - 35_278_831_616
    assert r["weights_fit"] and r["kv_budget_bytes"] == budget
    assert r["kv_capacity_tokens"] == budget // 81_920
    assert r["max_sequences"] == budget // (81_920 * 8192) == 62
    assert "step_s" not in r  # no hardware, no prediction


def test_kv_heads_beyond_the_size_are_replicated() -> None:
    r = kv_calc("llama3-8b", None, 8192, "bf16", 80, tensor_parallel_size=16)
    assert (r["kv_heads_per_device"], r["kv_replicas"]) == (1, 2)
    assert r["kv_bytes_per_token_per_device"] == 2 * 32 * 1 * 128 * 2  # as at 8 GPUs
    eight = kv_calc("llama3-8b", None, 8192, "bf16", 80, tensor_parallel_size=8)
    assert r["kv_bytes_per_token_per_device"] == eight["kv_bytes_per_token_per_device"]
    assert r["weight_bytes_per_device"] < eight["weight_bytes_per_device"]


def test_weights_that_do_not_fit_are_said_so_not_a_negative_budget() -> None:
    r = kv_calc("llama3-70b", None, 8192, "bf16", spec=H100, max_num_seqs=256)
    assert r["device_bytes"] == 80 * GIB  # the spec's memory
    assert not r["weights_fit"] and r["kv_budget_bytes"] == 0 and r["max_sequences"] == 0
    assert "step_s" not in r
    text = format_report(r)
    assert "left for KV            none: the weights per device (131.42 GiB) do not fit" in text
    assert "try engine.tensor_parallel_size=2|4|8|16|32|64" in text
    assert "-" not in text.split("left for KV")[1].split("try")[0]  # no negative figure


def test_device_memory_comes_from_the_spec_unless_given() -> None:
    h200 = hardware.spec_from_dict(hardware.load_spec_file("h200"))
    assert kv_calc("llama3-8b", None, 8192, "bf16", spec=h200)["device_bytes"] == 141 * GIB
    assert kv_calc("llama3-8b", None, 8192, "bf16", 100, spec=h200)["device_bytes"] == 100 * GIB
    assert kv_calc("llama3-8b", None, 8192, "bf16")["device_bytes"] == 80 * GIB  # no spec


def test_the_predicted_decode_step_by_hand() -> None:
    """tiny over 2 devices, 4 sequences of 512 tokens, on a made-up spec, every term by hand."""
    spec = HardwareSpec(
        "made-up",
        memory_bandwidth=1e9,
        peak_flops={"bfloat16": 1e12},
        memory_bytes=GIB,
        link_bandwidth=1e8,
        link_latency=1e-5,
    )
    r = kv_calc(
        "tiny", None, 1024, "bf16", None, tensor_parallel_size=2, spec=spec,
        context_len=512, max_num_seqs=4,
    )  # fmt: skip
    assert (r["batch"], r["batch_bound"]) == (4, "max_num_seqs")
    # per rank: 2 heads, 1 kv head of 16, intermediate 88, 2048 vocab rows of 64, 2 layers
    linear = 2 * (64 * (32 + 32) + 32 * 64 + 3 * 64 * 88)
    head = 2048 * 64
    weights_read = (linear + head) * 2  # the embedding's gather is not a read of the table
    kv_token = 2 * 2 * 1 * 16 * 2
    kv_moved = 4 * 512 * kv_token + 4 * kv_token  # read the context, write the new token
    assert r["weight_bytes_read_per_device"] == weights_read
    assert r["kv_bytes_moved_per_device"] == kv_moved
    memory_s = (weights_read + kv_moved) / 1e9
    flops = 2 * linear * 4 + 2 * head * 4 + 4 * 2 * 2 * 16 * (4 * 513)
    assert r["flops_per_device"] == flops
    compute_s = flops / 1e12
    # 5 all-reduces (2 layers x 2 + the embedding) of 4 x 64 x 2 bytes, 2 hops each; a gather
    # of 4 x 4096 bf16 logits (the compute dtype), 1 hop
    comm_s = 5 * (512 / 1e8 + 2 * 1e-5) + (0.5 * 4 * 4096 * 2 / 1e8 + 1e-5)
    assert r["memory_s"] == pytest.approx(memory_s)
    assert r["compute_s"] == pytest.approx(compute_s)
    assert r["comm_s"] == pytest.approx(comm_s)
    assert r["step_s"] == pytest.approx(max(memory_s, compute_s) + comm_s)
    assert r["tokens_per_s"] == pytest.approx(4 / (max(memory_s, compute_s) + comm_s))
    # a spec without a link: the step leaves communication out, and says so
    unlinked = replace(spec, link_bandwidth=None, link_latency=None)
    r = kv_calc(
        "tiny", None, 1024, "bf16", None, tensor_parallel_size=2, spec=unlinked,
        context_len=512, max_num_seqs=4,
    )  # fmt: skip
    assert r["comm_s"] is None and r["step_s"] == pytest.approx(max(memory_s, compute_s))
    assert "not counted" in format_report(r)


SPEC = HardwareSpec("made-up", memory_bandwidth=1e9, peak_flops={"float32": 1e12}, memory_bytes=GIB)


def test_a_moe_decode_step_reads_the_experts_its_tokens_touch() -> None:
    """tiny-moe (8 experts of 64, 2 per token, 2 layers): a step of 3 sequences reads the
    experts 3 tokens' 2 choices touch if routing is uniform, 8 x (1 - (6/8)^3) per layer, and
    computes 3 x 2 of them per layer; the rest of the blocks as a dense model's."""
    cfg = resolve_model("tiny-moe")
    r = kv_calc("tiny-moe", None, 512, "fp32", None, spec=SPEC, context_len=64, max_num_seqs=3)
    assert r["batch"] == 3
    expert = 3 * 64 * 64
    dense = cfg.num_parameters() - cfg.num_parameters(active=True)  # the experts not chosen
    assert dense == 2 * (8 - 2) * expert
    touched = 2 * 8 * (1 - (6 / 8) ** 3)
    blocks = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 8 * 64)  # q/k/v, o and the router, 2 layers
    assert r["weight_bytes_read_per_device"] == pytest.approx(
        4 * (blocks + touched * expert + 4096 * 64)
    )
    assert r["active_weight_bytes"] == 4 * cfg.num_parameters(active=True)
    one = kv_calc("tiny-moe", None, 512, "fp32", None, spec=SPEC, context_len=64, max_num_seqs=1)
    assert one["weight_bytes_read_per_device"] == pytest.approx(
        4 * (blocks + 2 * 2 * expert + 4096 * 64)
    )  # one token: its 2 experts in each layer


def test_windowed_layers_read_their_window_and_global_ones_the_context() -> None:
    """tiny-gemma2: layers 0 and 2 within a window of 64, 1 and 3 global; at a context of 256
    a decode reads 63 tokens in half the layers and 256 in the other half."""
    r = kv_calc("tiny-gemma2", None, 512, "fp32", None, spec=SPEC, context_len=256, max_num_seqs=2)
    per_token = 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 heads of 16, fp32
    read = 2 * (63 + 256) / 2  # per layer on average, 2 sequences
    assert r["kv_bytes_moved_per_device"] == pytest.approx((read + 2) * per_token)
    assert r["global_layers"] == 2 and r["sliding_window"] == 64
    # paged KV holds 64 tokens of the windowed layers (the hybrid cache) and all of the others'
    assert r["max_sequences"] == r["kv_capacity_tokens"] // ((64 + 512) / 2)
    free = kv_calc("tiny-gemma2", None, 512, "fp32", None, spec=SPEC, context_len=256)
    assert free["batch"] == r["kv_capacity_tokens"] // ((64 + 256) / 2)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = kv_calc_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_keeps_its_single_gpu_report(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["model=llama3-8b", "engine.max_model_len=8192", "engine.dtype=fp16"]
    code, out, _ = run_cli(capsys, *args, "device_memory_gib=80")
    assert code == 0
    assert out == (
        "llama3-8b in float16, max_model_len=8192\n"
        "  KV bytes per token     2 x 32 layers x 8 kv_heads x 128 x 2 B = 131,072 B (128 KiB; "
        "GQA 32/8 heads saves 4x)\n"
        "  KV bytes per sequence  1.00 GiB (1,073,741,824 B)\n"
        "  weight bytes           14.96 GiB (16,060,522,496 B)\n"
        "  device memory          80.00 GiB (85,899,345,920 B) x 0.9\n"
        "  left for KV            57.04 GiB (61,248,888,832 B)\n"
        "  sequences that fit     57 of 8192 tokens each\n"
    )


def test_cli_table_one_row_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "model=llama3-70b", "hardware=h100,h200", "engine.tensor_parallel_size=1,2,4,8"
    )
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("hardware"))
    rows = [line.split() for line in lines[header + 1 :]]
    assert [(row[0], row[1]) for row in rows] == [
        (gpu, tp) for gpu in ("h100", "h200") for tp in ("1", "2", "4", "8")
    ]
    # 70B in bf16 fits on neither a single H100 nor a single H200
    assert lines[header + 1].endswith("weights do not fit")
    assert lines[header + 5].endswith("weights do not fit")
    # the h100, 4-GPU row is kv_calc's figures
    r = kv_calc("llama3-70b", None, None, "auto", tensor_parallel_size=4, spec=H100,
                max_num_seqs=256)  # fmt: skip
    assert rows[2][2:6] == ["2", "32.86", "GiB", "80"]
    assert f"{r['kv_capacity_tokens']:,}" == rows[2][7] and f"{r['batch']:,}" == rows[2][9]
    assert rows[2][-2:] == [f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / 4:,.0f}"]
    assert f"{r['step_s'] * 1e3:,.2f}" in rows[2]
    # more GPUs hold more KV: the capacity grows with the size
    capacity = [int(row[7].replace(",", "")) for row in rows[1:4]]
    assert capacity == sorted(capacity) and capacity[0] < capacity[-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["model=small", "engine.tensor_parallel_size=3"],
            r"engine\.tensor_parallel_size: 3 is invalid .*; allowed: 1\|2\|4$",
        ),
        (
            ["model=small", "engine.tensor_parallel_size=1,3"],
            r"engine\.tensor_parallel_size: 3 is invalid .*; allowed: 1\|2\|4$",
        ),
        (["model=small", "context_len=0"], r"context_len: '0' is invalid"),
        (["model=small", "context_len=4096"], r"context_len: 4096 is invalid; .*\[1, 2048\]"),
        (["model=small", "device_memory_gib=-1"], r"device_memory_gib: '-1' is invalid"),
        # numbers past any real machine, NaN and inf: one line naming the range, not an
        # OverflowError traceback (1e308 GiB in bytes is inf)
        *(
            (
                ["model=small", f"device_memory_gib={value}"],
                rf"^device_memory_gib: '{value}' is invalid; allowed: a number in \(0, 1048576\]$",
            )
            for value in ("1e308", "inf", "nan", "2e6")
        ),
        *(
            (
                ["model=small", f"engine.gpu_memory_utilization={value}"],
                rf"^engine\.gpu_memory_utilization: {shown} is invalid; allowed: a number in "
                r"\(0, 1\]$",
            )
            for value, shown in (
                ("1e308", r"1e\+308"),
                ("nan", "nan"),
                ("inf", "inf"),
                ("0", "0.0"),
            )
        ),
        (
            ["model=small", "context_len=99999999999999999999999"],
            r"^context_len: '9+' is invalid; allowed: an integer in \[1, max_model_len\]$",
        ),
        (
            ["model=small", "engine.max_model_len=99999999999"],
            r"^engine\.max_model_len: 99999999999 is invalid; allowed: an integer in \[1, 2048\]",
        ),
        (["model=small", "engine.max_num_seqs=0"], r"^engine\.max_num_seqs: 0 is invalid"),
        (["model=small", "engine.max_model_len=-1"], r"engine\.max_model_len: -1 is invalid"),
        (["model=small", "engine.max_model_len=0"], r"engine\.max_model_len: 0 is invalid"),
        (["model=small", "hardware=tpu"], r"Could not find 'hardware/tpu'"),
        # planned as unquantized weights and a 2-byte KV cache, without a word
        (
            ["model=llama3-8b", "engine.quantization=int4"],
            r"^engine\.quantization: 'int4' is not planned by kv-calc, .*; allowed: none ",
        ),
        (["model=small", "variant=int8"], r"^engine\.quantization: 'int8' is not planned"),
        (["model=small", "hardware=h100,tpu"], r"Could not find 'hardware/tpu'"),
    ],
)
def test_cli_errors_name_the_key(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert re.search(message, err.strip().removeprefix("error: ")), err


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


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_options_not_a_hydra_lexer_error(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """Before: exit 2, 'error: LexerNoViableAltException: --help ^ See https://hydra.cc/...'."""
    code, out, err = run_cli(capsys, "model=tiny", flag)
    assert code == 0 and err == ""
    assert out.startswith("usage: inferlab kv-calc")
    for option in (
        "device_memory_gib=",
        "context_len=",
        "engine.tensor_parallel_size=",
        "hardware=",
    ):
        assert option in out


def test_model_hf_without_a_path_names_model_path(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "model: 'hf' is neither a preset (...), an existing checkpoint folder nor a
    .gguf file", where inferlab run names model.path."""
    code, out, err = run_cli(capsys, "model=hf")
    assert code == 2 and out == ""
    assert err == (
        "error: model.path: required for model=hf (a local Hugging Face checkpoint folder "
        "with config.json and *.safetensors)\n"
    )


def test_a_trained_model_is_planned_from_its_checkpoint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before: "model: 'tiny-trained' is neither a preset (...)", though `inferlab run
    model=tiny-trained` runs it: kv-calc resolved model names apart from the backends."""
    folder = write_tiny_checkpoint(tmp_path / "trained")
    monkeypatch.setattr(train_tiny, "cached_tiny_model", lambda **settings: folder)
    code, out, err = run_cli(capsys, "model=tiny-trained", "device_memory_gib=1")
    assert (code, err) == (0, "")
    tiny = resolve_model("tiny")
    assert out.startswith("tiny-trained in bfloat16, max_model_len=256\n")
    assert f"{tiny.num_layers} layers x {tiny.num_kv_heads} kv_heads" in out
