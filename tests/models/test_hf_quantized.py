"""Quantized Hugging Face folders read as their quantizers wrote them (models/hf_quantized.py):
each linear's stored tensors put together into the weight they stand for. compressed-tensors
folders are written by compressed-tensors itself and checked against transformers' own loading
of them (which decompresses through compressed-tensors); AWQ and GPTQ folders are written in
their documented layouts (tests/quantized_folders.py) and checked against the levels and scales
before packing. Bad folders and configs fail with one line naming the tensor or the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from quantized_folders import (
    linears,
    small_llama,
    write_awq,
    write_compressed_tensors,
    write_fp8,
    write_gptq,
)
from safetensors.torch import load_file, save_file

from models.config import UnsupportedCheckpointError, from_hf_config
from models.quantized_weight import QuantizedWeight
from models.weights import iter_checkpoint

pytest.importorskip("compressed_tensors", reason="the dev extra: make setup-dev")


def read(folder: Path) -> dict[str, Any]:
    return dict(iter_checkpoint(folder, keep_quantized=True))


WRITERS = {
    "awq-g128": lambda m, d: write_awq(m, d, 128),
    "awq-g64": lambda m, d: write_awq(m, d, 64),
    "gptq-w4-g32": lambda m, d: write_gptq(m, d, 4, 32),
    "gptq-w4-g64-act-order": lambda m, d: write_gptq(m, d, 4, 64, act_order=True),
    "gptq-w8-per-channel-v2-asym": lambda m, d: write_gptq(
        m, d, 8, -1, checkpoint_format="gptq_v2", symmetric=False
    ),
    "gptq-w8-g128-act-order": lambda m, d: write_gptq(m, d, 8, 128, act_order=True),
    # 256 and 512 inputs in groups of 96: AutoGPTQ's shorter last group, held in groups of 32
    "gptq-w4-g96": lambda m, d: write_gptq(m, d, 4, 96),
}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_awq_and_gptq_folders_give_back_the_weights_they_were_packed_from(
    kind: str, tmp_path: Path
) -> None:
    folder, reference = WRITERS[kind](small_llama(), tmp_path / kind)
    tensors = read(folder)
    for module, weight in reference.items():
        stored = tensors[module + ".weight"]
        assert isinstance(stored, QuantizedWeight), module
        assert torch.equal(stored.dequantize(), weight), module  # exact: small integers x fp16
        assert ("act-order" in stored.source) == ("act-order" in kind)
    floats = dict(iter_checkpoint(folder))  # dequantized where the engine is not to keep them
    assert torch.equal(floats[module + ".weight"], weight)
    assert not any(isinstance(t, QuantizedWeight) for t in floats.values())


@pytest.mark.parametrize(
    ("scheme", "source"),
    [
        ("W4A16", "compressed-tensors W4 g128"),
        ("W4A16_ASYM", "compressed-tensors W4 g128"),
        ("W8A16", "compressed-tensors W8 g128"),
        ("W8A8", "compressed-tensors W8 per-channel"),  # int-quantized: int8 weights
        ("FP8", "FP8 e4m3 per-tensor"),
        ("FP8_DYNAMIC", "FP8 e4m3 per-channel"),
    ],
)
def test_compressed_tensors_folders_equal_transformers_own_decompression(
    scheme: str, source: str, tmp_path: Path
) -> None:
    import transformers

    folder = write_compressed_tensors(small_llama(), tmp_path / scheme, scheme)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False),
    )
    tensors = read(folder)
    for module, layer in linears(reference).items():
        stored = tensors[module + ".weight"]
        assert isinstance(stored, QuantizedWeight) and stored.source == source, module
        # q * scale + min against (q - zero) * scale: float32 rounding apart at most
        torch.testing.assert_close(stored.dequantize(), layer.weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_vllm_fp8_folders_give_their_values_times_their_scales(
    block: tuple[int, int] | None, tmp_path: Path
) -> None:
    """vLLM's own fp8 checkpoints: a scale a tensor (AutoFP8), or a block's (DeepSeek's
    weight_scale_inv), read back against the stored values times the stored scales."""
    folder = write_fp8(small_llama(), tmp_path / "fp8", block)
    stored = load_file(str(folder / "model.safetensors"))
    tensors = read(folder)
    for module in {n.rsplit(".", 1)[0] for n in stored if n.endswith("_proj.weight")}:
        values = stored[module + ".weight"].float()
        if block is None:
            expected = values * stored[module + ".weight_scale"]
        else:
            scale = stored[module + ".weight_scale_inv"]
            expected = values * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        weight = tensors[module + ".weight"]
        assert weight.source == ("FP8 e4m3 per-tensor" if block is None else "FP8 e4m3 g128")
        assert torch.equal(weight.dequantize(), expected), module


def test_a_per_channel_weight_cuts_any_columns_and_act_order_refuses_them(tmp_path: Path) -> None:
    folder = write_compressed_tensors(small_llama(), tmp_path / "fp8", "FP8_DYNAMIC")
    weight = read(folder)["model.layers.0.mlp.down_proj.weight"]
    half = weight.columns(slice(0, 200))  # one scale a row: no groups to straddle
    assert torch.equal(half.dequantize(), weight.dequantize()[:, :200])
    folder, _ = write_gptq(small_llama(), tmp_path / "gptq", 4, 64, act_order=True)
    permuted = read(folder)["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"act-order.*allowed: the whole width"):
        permuted.columns(slice(0, 256))


def _rewrite(folder: Path, change: Any) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _set_config(folder: Path, **fields: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(fields)
    (folder / "config.json").write_text(json.dumps(config))


def test_bad_folders_name_the_tensor(tmp_path: Path) -> None:
    folder, _ = write_awq(small_llama(), tmp_path / "awq", 128)
    _set_config(folder, group_size=64)  # the tensors were written with groups of 128
    with pytest.raises(ValueError, match=r"_proj\.scales: shape \((\d+), 256\), AWQ g64 wants"):
        read(folder)

    folder, _ = write_gptq(small_llama(), tmp_path / "gptq", 4, 32)
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.o_proj.qzeros"))
    with pytest.raises(ValueError, match=r"o_proj\.qzeros missing"):
        read(folder)

    folder = write_compressed_tensors(small_llama(), tmp_path / "w8a8", "W8A8")
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(folder, lambda t: t.update({name: t[name].to(torch.int16)}))
    with pytest.raises(ValueError, match=r"up_proj\.weight: torch\.int16; .* wants int8"):
        read(folder)

    folder = write_compressed_tensors(small_llama(), tmp_path / "asym", "W4A16_ASYM")
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.gate_proj.weight_zero_point"))
    with pytest.raises(ValueError, match=r"gate_proj\.weight_zero_point missing"):
        read(folder)

    folder = write_compressed_tensors(small_llama(), tmp_path / "fp8", "FP8_DYNAMIC")

    def nan_byte(tensors: dict) -> None:
        tensors[name].view(torch.uint8)[3, 5] = 0x7F  # e4m3's NaN

    _rewrite(folder, nan_byte)
    with pytest.raises(ValueError, match=r"up_proj\.weight: FP8 values hold NaN"):
        read(folder)


def test_hostile_folders_name_the_tensor(tmp_path: Path) -> None:
    """The hostile pass of issue 43: each once loaded with a wrong answer or a traceback."""
    folder = write_compressed_tensors(small_llama(), tmp_path / "w8", "W8A16")
    _set_config(folder, config_groups={"g": {"weights": {"num_bits": 4, "strategy": "group",
                                                          "group_size": 128}}})  # fmt: skip
    with pytest.raises(ValueError, match=r"weight_packed: shape \(256, \d+\), .*W4 of .* wants"):
        read(folder)  # 8-bit words read as 4-bit levels: garbage, once

    folder, _ = write_awq(small_llama(), tmp_path / "awq", 128)
    name = "model.layers.0.self_attn.q_proj"
    _rewrite(folder, lambda t: t.update({name + ".qweight": t[name + ".qweight"].float()}))
    with pytest.raises(ValueError, match=r"q_proj\.qweight: torch\.float32; allowed: int32"):
        read(folder)

    folder, _ = write_awq(small_llama(), tmp_path / "awq-nan", 128)
    _rewrite(folder, lambda t: t[name + ".scales"].__setitem__((0, 0), float("nan")))
    with pytest.raises(ValueError, match=r"q_proj: its scales hold NaN or infinity"):
        read(folder)

    folder, _ = write_gptq(small_llama(), tmp_path / "gptq", 4, 32)
    _rewrite(folder, lambda t: t.pop(name + ".qweight"))  # its qzeros, scales, g_idx remain
    with pytest.raises(ValueError, match=r"q_proj\.qweight missing"):
        read(folder)

    folder = write_compressed_tensors(small_llama(), tmp_path / "fp8", "FP8_DYNAMIC")
    _rewrite(folder, lambda t: t.pop(name + ".weight_scale"))  # FP8 values without a scale
    with pytest.raises(ValueError, match=r"q_proj\.weight' is torch\.float8_e4m3fn"):
        read(folder)

    folder = write_compressed_tensors(small_llama(), tmp_path / "shape", "W4A16")
    _rewrite(folder, lambda t: t.update({name + ".weight_shape": torch.tensor([256, 256, 1])}))
    with pytest.raises(ValueError, match=r"q_proj\.weight_shape: \[256, 256, 1\]; allowed"):
        read(folder)


@pytest.mark.parametrize("targets", [["re:("], [1], "Linear"])
def test_compressed_tensors_targets_are_checked(targets: Any, tmp_path: Path) -> None:
    folder = write_compressed_tensors(small_llama(), tmp_path / "w4", "W4A16")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = targets
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match=r"group_0\.targets=.*allowed: a list"):
        from_hf_config(folder)


def test_an_integer_tensor_without_a_quantization_config_is_refused(tmp_path: Path) -> None:
    folder, _ = write_gptq(small_llama(), tmp_path / "gptq", 4, 32)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"_proj\.\w+' is torch\.int32; .*quantization_config"):
        read(folder)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'.*awq|gptq"),
        ({"quant_method": "awq", "version": "gemv"}, "version='gemv'.*allowed: gemm"),
        ({"quant_method": "awq", "version": None}, "version=None.*allowed: gemm"),
        ({"quant_method": "awq", "zero_point": False}, "zero_point=False.*allowed: True"),
        ({"quant_method": "gptq", "bits": 3}, r"bits=3.*allowed: 4\|8"),
        ({"quant_method": "gptq", "group_size": 0}, "group_size=0.*-1"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({"quant_method": "compressed-tensors"}, "config_groups must be a non-empty object"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
        ({"quant_method": "fp8", "activation_scheme": "per-token"}, "activation_scheme"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 2}}},
            },
            r"num_bits=2.*allowed: 4\|8",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4}}},
            },
            "format='nvfp4-pack-quantized'.*pack-quantized",
        ),
    ],
)
def test_an_unsupported_quantization_config_names_the_key(
    config: dict, named: str, tmp_path: Path
) -> None:
    folder, _ = write_gptq(small_llama(), tmp_path / "q", 4, 32)
    full = json.loads((folder / "config.json").read_text())
    full["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(full))
    with pytest.raises(UnsupportedCheckpointError, match=named):
        from_hf_config(folder)
