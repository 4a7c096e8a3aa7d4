"""AWQ, GPTQ and compressed-tensors folders run as stored (`engine.quantization=auto`): every
linear layer in the engine's INT4 / INT8 / FP8 kernels, the greedy tokens of the dequantized
model and of transformers (which reads compressed-tensors folders itself), logits to float32
rounding; act-order through an input permutation; `engine.quantization=fp8` on a float folder
equal to compressed-tensors' own FP8 checkpoint of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from quantized_folders import (
    small_llama,
    write_awq,
    write_compressed_tensors,
    write_fp8,
    write_gptq,
)
from transformers_greedy import hf_greedy

from engines.builtin import LLM, SamplingParams
from engines.builtin.layers import make_linear_method
from engines.builtin.layers.linear import Linear
from harness.measuring.quality import prompt_logits
from models.quantized_weight import QuantizedWeight

pytest.importorskip("compressed_tensors", reason="the dev extra: make setup-dev")

PROMPTS = [[5, 17, 99, 3, 250, 31], [7, 8, 9], [200, 100, 50, 25, 12, 6, 3, 1, 4, 1, 5]]


def engine(path: Path, **options: object) -> LLM:
    return LLM(model=str(path), max_model_len=128, max_num_seqs=4, kv_cache_prefault=False,
               **options)  # fmt: skip


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


def transformers_greedy(model: Any) -> list[list[int]]:
    return [hf_greedy(model, prompt, 12) for prompt in PROMPTS]


def decoder_methods(llm: LLM) -> list[str]:
    methods = llm.engine.describe()["linear_methods"]
    return [m for name, m in methods.items() if "lm_head" not in name]


def with_reference_weights(model: Any, reference: dict[str, torch.Tensor]) -> Any:
    """`model` with each linear holding the weight its packed levels stand for."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name in reference:
                module.weight.copy_(reference[name])
    return model


FOLDERS = {
    "awq-g128": (lambda m, d: write_awq(m, d, 128), "int4 g128"),
    "gptq-w4-g32": (lambda m, d: write_gptq(m, d, 4, 32), "int4 g32"),
    "gptq-w4-act-order": (lambda m, d: write_gptq(m, d, 4, 64, act_order=True), "int4 g64"),
    "gptq-w4-g96": (lambda m, d: write_gptq(m, d, 4, 96), "int4 g32"),  # a short last group
    "gptq-w8-v2": (
        lambda m, d: write_gptq(m, d, 8, 32, checkpoint_format="gptq_v2"),
        "int8 blocks g32",  # symmetric with float16 scales: Q8_0's layout
    ),
}


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_awq_and_gptq_folders_run_as_stored_with_transformers_tokens(
    kind: str, tmp_path: Path
) -> None:
    write, layout = FOLDERS[kind]
    model = small_llama()
    folder, reference = write(model, tmp_path / kind)
    llm = engine(folder)
    methods = decoder_methods(llm)
    assert all(f"as {layout} (exact" in m and "kernel native" in m for m in methods), methods
    assert all(("act-order" in m) == ("act-order" in kind) for m in methods), methods
    tokens = greedy(llm)
    assert tokens == transformers_greedy(with_reference_weights(model, reference))
    dequantized = engine(folder, quantization="none")
    assert tokens == greedy(dequantized)
    got, want = prompt_logits(llm, PROMPTS), prompt_logits(dequantized, PROMPTS)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5 * float(b.std()))


@pytest.mark.parametrize(
    ("scheme", "layout"),
    [
        ("W4A16", "int4 g128"),
        ("W4A16_ASYM", "int4 g128"),
        ("W8A16", "grouped int8 g32"),  # float32 scales: not float16 blocks
        ("FP8", "fp8 a scale a row"),
        ("FP8_DYNAMIC", "fp8 a scale a row"),
    ],
)
def test_compressed_tensors_folders_run_as_stored_with_transformers_tokens(
    scheme: str, layout: str, tmp_path: Path
) -> None:
    import transformers

    folder = write_compressed_tensors(small_llama(), tmp_path / scheme, scheme)
    llm = engine(folder)
    methods = decoder_methods(llm)
    assert all(f"as {layout} (exact)" in m and "kernel native" in m for m in methods), methods
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False),
    ).eval()
    tokens = greedy(llm)
    assert tokens == transformers_greedy(reference)
    assert tokens == greedy(engine(folder, quantization="none"))


@pytest.mark.parametrize(
    ("block", "kept"),
    [(None, "as fp8 a scale a row (exact)"), ((128, 128), "dequantized at load (FP8 in groups")],
)
def test_vllm_fp8_folders_give_the_dequantized_model_s_tokens(
    block: tuple[int, int] | None, kept: str, tmp_path: Path
) -> None:
    folder = write_fp8(small_llama(), tmp_path / "fp8", block)
    llm = engine(folder)
    assert all(kept in m for m in decoder_methods(llm)), decoder_methods(llm)
    assert greedy(llm) == greedy(engine(folder, quantization="none"))


def test_fp8_at_load_is_compressed_tensors_fp8_dynamic_of_the_same_model(tmp_path: Path) -> None:
    """Both scale each row by max|w| / 448 and round to the nearest e4m3 value: the same
    weights, so the same logits."""
    float_folder = tmp_path / "float"
    small_llama().save_pretrained(float_folder)
    from checkpoints import write_word_tokenizer

    write_word_tokenizer(float_folder, 300)
    at_load = engine(float_folder, quantization="fp8", quantize_lm_head=False)  # as ct's
    assert all("FP8 e4m3 per-channel (at load) as fp8" in m for m in decoder_methods(at_load))
    stored = engine(write_compressed_tensors(small_llama(), tmp_path / "ct", "FP8_DYNAMIC"))
    for a, b in zip(prompt_logits(at_load, PROMPTS), prompt_logits(stored, PROMPTS), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(b.std()))
    assert greedy(at_load) == greedy(stored)


def test_fp8_without_the_c_kernels_is_dequantized_at_load(tmp_path: Path) -> None:
    folder = write_compressed_tensors(small_llama(), tmp_path / "fp8", "FP8_DYNAMIC")
    plain = engine(folder, native_kernels=False)
    assert all("dequantized at load" in m for m in decoder_methods(plain))
    assert greedy(plain) == greedy(engine(folder))


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("smollm2-135m-awq-g64", "int4 g64"),
        ("smollm2-135m-gptq-w4-g64-act-order", "int4 g64"),
        ("smollm2-135m-w8a16", "grouped int8 g32"),
        ("smollm2-135m-fp8", "fp8 a scale a row"),
    ],
)
def test_smollm2_folders_give_the_dequantized_model_s_greedy_tokens(name: str, layout: str) -> None:
    """The real model's folders, written from its F16 re-encoding (models/hf_quantize.py)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for quantization in ("auto", "none"):
        with LLM(model=name, quantization=quantization, max_model_len=256) as llm:
            outputs[quantization] = [o.token_ids for o in llm.generate(prompts, params)]
            if quantization == "auto":
                methods = decoder_methods(llm)
    assert all(f"as {layout} (exact" in m and "kernel native" in m for m in methods), methods
    assert outputs["auto"] == outputs["none"]


def auto_linear(in_features: int, out_features: int) -> Linear:
    method = make_linear_method("auto", native_reason=None)
    layer = Linear(in_features, out_features, method)
    layer.name = "test.proj"
    return layer


def random_levels(out: int, k: int, group: int, bits: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(group)
    q = torch.randint(0, 2**bits, (out, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out, k // group, generator=gen) * 0.02 + 1e-3).half().float()
    mins = -scales * torch.randint(0, 2**bits, scales.shape, generator=gen)
    return QuantizedWeight(q, scales, mins, group, bits, "test")


def test_int4_groups_the_kernels_cannot_index_are_split_into_32s() -> None:
    """The INT4 kernels find a block's group by a shift: groups of 96 (GPTQ allows any) are
    held as groups of 32, the same scales repeated, exactly."""
    weight = random_levels(8, 192, 96, 4)
    layer = auto_linear(192, 8)
    layer.load(weight, None)
    assert "as int4 g32 (exact)" in layer.method.describe(layer)
    x = torch.randn(3, 192)
    torch.testing.assert_close(layer(x), x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


def test_an_act_order_shard_of_a_row_parallel_layer_is_dequantized_at_load() -> None:
    weight = random_levels(8, 128, 32, 4)
    order = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    permuted = QuantizedWeight(
        weight.q, weight.scales, weight.mins, 32, 4, "act", input_order=order
    )
    layer = auto_linear(64, 8)
    layer.load(permuted, None, slice(64, 128))  # the second rank's half of the inputs
    assert "dequantized at load (act-order inputs cut by tensor parallelism)" in (
        layer.method.describe(layer)
    )
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), x @ permuted.dequantize()[:, 64:].T)
