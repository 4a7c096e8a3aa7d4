"""The dense linear methods: the prepacked CPU paths (oneDNN's layout, the engine's panels)
against F.linear, and end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.builtin import LLM, SamplingParams, native
from engines.builtin.layers import make_linear_method
from engines.builtin.layers.linear import Linear, PanelDenseMethod, PrepackedDenseMethod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 3, 48)])
def test_prepacked_equals_f_linear(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 48, generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    layer = Linear(48, 80, PrepackedDenseMethod(), bias=True)
    layer.load(weight, bias)
    x = torch.randn(*shape, generator=gen).to(dtype)
    got, want = layer(x), F.linear(x, weight, bias)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # a forward reads one copy of the weight: the packed copy is not counted twice
    assert layer.weight_bytes() == (weight.numel() + bias.numel()) * weight.element_size()


def test_prepacked_without_onednn_bf16_keeps_the_plain_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU without native bf16 conversion (AVX2 only: oneDNN's bf16 reorder raises there)
    keeps no packed copy and multiplies through F.linear, with the same result."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not PrepackedDenseMethod.supported(torch.device("cpu"), torch.bfloat16)
    assert PrepackedDenseMethod.supported(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 48, generator=gen).to(torch.bfloat16)
    layer = Linear(48, 80, PrepackedDenseMethod(), bias=False)
    layer.load(weight, None)
    assert layer.packed_weight is None and layer.packed_bytes() == 0
    x = torch.randn(5, 48, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, weight))


# rows through the engine's GEMM (flattened); one row goes to torch's GEMV, faster there
@pytest.mark.parametrize(
    ("shape", "kernel_rows"), [((1, 48), None), ((5, 48), 5), ((2, 3, 48), 6), ((0, 48), 0)]
)
def test_panels_equal_f_linear(
    shape: tuple[int, ...], kernel_rows: int | None, monkeypatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(80, 48, generator=gen), torch.randn(80, generator=gen)
    layer = Linear(48, 80, PanelDenseMethod(), bias=True)
    layer.load(weight, bias)
    panel = native.layout().panel  # panels of the build's width (32 with AVX-512, 16 AVX2)
    assert layer.panels.shape == (-(-80 // panel), 48, panel)
    calls = []
    kernel = native.linear
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    x = torch.randn(*shape, generator=gen)
    got = layer(x)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == ([] if kernel_rows is None else [(kernel_rows, 48)])
    strided = torch.randn(48, 2, generator=gen).T
    torch.testing.assert_close(layer(strided), F.linear(strided, weight, bias))
    long = torch.randn(PanelDenseMethod.MAX_ROWS + 1, 48, generator=gen)
    torch.testing.assert_close(layer(long), F.linear(long, weight, bias), rtol=1e-5, atol=1e-5)
    # a strided input and a long one took the plain weight (F.linear)
    assert len(calls) == (kernel_rows is not None)
    assert layer.weight_bytes() == (weight.numel() + bias.numel()) * 4  # one copy is read


def test_panels_take_a_strided_bias_and_leave_gradients_to_torch() -> None:
    layer = Linear(16, 40, PanelDenseMethod(), bias=True)
    weight, bias = torch.randn(40, 16), torch.randn(80)[::2]  # a strided bias is stored whole
    layer.load(weight, bias)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)
    y = layer(x)  # through F.linear: the kernel has no backward
    y.sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(3, 16))


def test_make_linear_method_names_the_prepacked_layouts() -> None:
    assert isinstance(make_linear_method("none", prepack="panels"), PanelDenseMethod)
    assert isinstance(make_linear_method("none", prepack="onednn"), PrepackedDenseMethod)
    with pytest.raises(ValueError, match=r"prepack.*panels\|onednn"):
        make_linear_method("none", prepack="mkl")


@pytest.mark.parametrize("native_kernels", [True, False])
def test_engine_tokens_do_not_depend_on_prepacking(native_kernels: bool) -> None:
    """fp32 on CPU packs panels for the engine's GEMM with its C kernels on, oneDNN's layout
    with them off; the tokens are the plain weight's either way."""
    prompts = [list(range(10, 40)), list(range(50, 57)), [7, 8, 9, 10]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for prepack in (False, True):
        llm = LLM("tiny", dtype="float32", prepack_weights=prepack, native_kernels=native_kernels)
        facts = llm.engine.describe()
        assert facts["prepacked_weights"] is prepack
        assert facts["prepacked_layout"] == (
            None if not prepack else "panels" if native_kernels else "onednn"
        )
        runs[prepack] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert runs[True] == runs[False]


def test_a_tied_lm_head_is_the_embedding_through_the_packed_kernel(monkeypatch) -> None:
    """A tied head kept dense (quantize_lm_head=false) shares the embedding's storage (no
    second plain copy, counted once) and multiplies through the panels like the other dense
    layers."""
    llm = LLM(
        "tiny",
        dtype="float32",
        model_overrides={"tie_word_embeddings": True},
        quantization="int8",
        quantize_lm_head=False,
    )
    model = llm.engine.runner.model
    head = model.lm_head
    assert isinstance(head.method, PanelDenseMethod)
    assert head.weight.data_ptr() == model.embed.weight.data_ptr()
    sizes = model.weight_bytes()
    assert sizes["lm_head_bytes"] == sizes["embedding_bytes"]
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert sizes["weight_bytes"] == (
        sizes["linear_weight_bytes"] + sizes["embedding_bytes"] + norms
    )
    hidden = torch.randn(5, model.config.hidden_size)
    calls = []
    kernel = native.linear
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(a[2]) or kernel(*a))
    logits = model.compute_logits(hidden)
    assert calls == [model.config.vocab_size]
    torch.testing.assert_close(logits, F.linear(hidden, model.embed.weight))


def test_a_tied_lm_head_quantized_is_a_copy_of_the_embedding() -> None:
    """quantize_lm_head on a tied model: the head multiplies a quantized copy of the embedding
    table (the lookup keeps the float table), through the engine's INT8 kernel; both counted."""
    llm = LLM(
        "tiny",
        dtype="float32",
        model_overrides={"tie_word_embeddings": True},
        quantization="int8",
        quantize_lm_head=True,
    )
    model = llm.engine.runner.model
    head = model.lm_head
    assert head.method.name == "int8" and head.native and head.weight is None
    vocab, hidden = model.embed.weight.shape
    sizes = model.weight_bytes()
    assert sizes["lm_head_bytes"] == vocab * hidden + vocab * 4  # int8 values, float32 scales
    assert sizes["weight_bytes"] == (
        sizes["linear_weight_bytes"]
        + sizes["embedding_bytes"]
        + sizes["lm_head_bytes"]
        + sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    )
    x = torch.randn(3, hidden)
    expected = x.double() @ head.method.dequantize(head).double().T
    torch.testing.assert_close(model.compute_logits(x).double(), expected, rtol=0, atol=1e-4)
    err = head.method.dequantize(head) - model.embed.weight
    assert float(err.abs().max()) <= float(head.scales.max()) / 2 + 1e-6
