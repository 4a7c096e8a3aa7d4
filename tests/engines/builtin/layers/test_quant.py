"""Weight-only quantized linear layers (issue 5): INT8 per-channel and INT4 group-wise.

Round trips stay within the half-step bound of each scheme, the packed CPU kernels agree with
the dequantize-then-matmul reference, the engine generates with either method, the stored
bytes shrink as the formats promise, and impossible shapes are refused by layer name.
"""

from __future__ import annotations

import pytest
import torch

from engines.base import ConfigError
from engines.builtin import LLM, EngineConfig, SamplingParams
from engines.builtin.layers import make_linear_method
from engines.builtin.layers.linear import DenseMethod, Linear
from engines.builtin.layers.quant import Int4Method, Int8Method

EPS = 1e-6  # float32 rounding of the scale arithmetic


def make_layer(
    method, out: int, inn: int, dtype=torch.float32, seed: int = 0, bias: bool = False
) -> tuple[Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, inn, generator=gen) * 0.05).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    layer = Linear(inn, out, method, bias=bias)
    layer.name = "test.proj"
    layer.load(w, b)
    return layer, w


@pytest.mark.parametrize(("out", "inn"), [(64, 128), (48, 96), (10, 33)])
def test_int8_round_trip_within_half_a_step(out: int, inn: int) -> None:
    method = Int8Method()
    layer, w = make_layer(method, out, inn)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127
    err = (w - method.dequantize(layer)).abs()
    assert (err <= layer.scales[:, None] / 2 + EPS).all()


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("out", [64, 40])  # 40: not packable (N % 16), plain-nibble path
def test_int4_round_trip_within_half_a_step(group: int, out: int) -> None:
    method = Int4Method(group)
    layer, w = make_layer(method, out, 256)
    assert layer.int4_packed == (out % 16 == 0)
    scale = layer.scales_and_zeros[..., 0].T.repeat_interleave(group, dim=1)  # [out, in]
    err = (w - method.dequantize(layer)).abs()
    assert (err <= scale / 2 + EPS).all()
    # and the integer grid is really 16 levels: (deq - zero_f) / scale + 8 in [0, 15]
    zero = layer.scales_and_zeros[..., 1].T.repeat_interleave(group, dim=1)
    levels = (method.dequantize(layer) - zero) / scale + 8
    assert torch.allclose(levels, levels.round(), atol=1e-3)
    assert levels.min() >= -1e-3 and levels.max() <= 15 + 1e-3


# Kernel vs reference: float32 is exact up to summation order (rtol 1e-4 of the output's scale);
# bfloat16 rounds x and the output to 8 mantissa bits, so allow 2% of the output's max |y|.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("method", "out", "inn"),
    [
        (Int8Method(), 64, 128),
        (Int8Method(), 96, 200),
        (Int4Method(32), 64, 128),
        (Int4Method(64), 48, 256),
        (Int4Method(128), 32, 384),
        (Int4Method(32), 24, 64),  # not packable: dequantize path
    ],
)
def test_kernels_match_the_dequantized_reference(
    method, out: int, inn: int, dtype: torch.dtype
) -> None:
    layer, _ = make_layer(method, out, inn, dtype=dtype, bias=True)
    x = torch.randn(3, 5, inn).to(dtype)
    y = layer(x)
    assert y.shape == (3, 5, out) and y.dtype == dtype
    ref = x.float() @ method.dequantize(layer).T + layer.bias.float()
    assert (y.float() - ref).abs().max() <= TOL[dtype] * ref.abs().max()


def test_weight_bytes_are_the_stored_bytes() -> None:
    layer, _ = make_layer(Int8Method(), 64, 128, dtype=torch.bfloat16)
    assert layer.weight_bytes() == 64 * 128 + 64 * 2
    layer, _ = make_layer(Int4Method(32), 64, 128, dtype=torch.bfloat16)
    assert layer.weight_bytes() == 64 * 128 // 2 + (128 // 32) * 64 * 2 * 2
    layer, _ = make_layer(Int4Method(32), 24, 64, dtype=torch.bfloat16)  # plain nibbles
    assert layer.weight_bytes() == 24 * 64 // 2 + (64 // 32) * 24 * 2 * 2


def test_make_linear_method() -> None:
    assert isinstance(make_linear_method("none"), DenseMethod)
    assert isinstance(make_linear_method("int8"), Int8Method)
    method = make_linear_method("int4", 64)
    assert isinstance(method, Int4Method) and method.group_size == 64
    with pytest.raises(
        ValueError,
        match=r"engine.quantization: 'fp8' is invalid; allowed: "
        r"none\|int8\|int4",
    ):
        make_linear_method("fp8")


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello, world! The quick brown fox", [100, 200, 300]]


@pytest.mark.parametrize(
    ("options"),
    [
        dict(quantization="int8"),
        dict(
            quantization="int4",
            quantization_group_size=32,
            model_overrides={"intermediate_size": 192},
        ),
        dict(
            quantization="int4",
            quantization_group_size=64,
            quantize_lm_head=True,
            model_overrides={"intermediate_size": 192},
        ),
    ],
)
def test_engine_generates_reproducibly(make_tiny, options) -> None:
    runs = []
    for _ in range(2):
        llm = make_tiny(**options)
        outs = llm.generate(PROMPTS, GREEDY)
        runs.append([o.token_ids for o in outs])
        for o in outs:
            assert len(o.token_ids) == 12
            assert all(0 <= t < llm.tokenizer.vocab_size for t in o.token_ids)
            assert isinstance(o.text, str)
    assert runs[0] == runs[1]
    model = llm.engine.runner.model
    head = model.lm_head
    assert head is not None
    assert head.method.name == (
        options["quantization"] if options.get("quantize_lm_head") else "none"
    )
    assert all(
        m.method.name == options["quantization"]
        for n, m in model.linear_layers().items()
        if n.startswith("layers.")
    )


def test_int4_on_a_dimension_no_group_divides_names_the_layer(make_tiny) -> None:
    # tiny's intermediate_size is 176 = 16 x 11: down_proj's input fits no int4 group size.
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.mlp\.down_proj.*in=176.*not divisible "
        r"by quantization_group_size=32",
    ):
        make_tiny(quantization="int4", quantization_group_size=32)
    with pytest.raises(ValueError, match=r"use quantization_group_size=32\|64$"):  # the hint
        Linear(192, 16, Int4Method(128)).load(torch.zeros(16, 192))


def test_config_validates_the_new_options() -> None:
    with pytest.raises(
        ConfigError,
        match=r"quantization_group_size: 48 is invalid; "
        r"allowed: 32\|64\|128",
    ):
        EngineConfig.from_dict({"quantization": "int4", "quantization_group_size": 48})
    with pytest.raises(ConfigError, match="quantize_lm_head"):
        EngineConfig.from_dict({"quantize_lm_head": "yes"})
    config = EngineConfig.from_dict({"quantization": "int4", "quantization_group_size": 32})
    assert config.quantization == "int4" and not config.quantize_lm_head


def test_small_linear_bytes_shrink() -> None:
    """On the `small` shape: int8 <= 0.52x and int4 (group 128) <= 0.30x of bf16 dense bytes."""
    built = {}
    for quant in ("int8", "int4"):
        llm = LLM(
            model="small",
            dtype="bfloat16",
            device="cpu",
            max_model_len=64,
            max_num_seqs=1,
            quantization=quant,
            kv_cache_memory_bytes=1 << 24,
        )
        model = llm.engine.runner.model
        params = sum(
            m.in_features * m.out_features
            for n, m in model.linear_layers().items()
            if n.startswith("layers.")
        )
        built[quant] = model.weight_bytes()["linear_weight_bytes"] / (params * 2)
        assert model.lm_head is None or model.lm_head.method.name == "none"
        del llm
    assert built["int8"] <= 0.52 and built["int4"] <= 0.30, built
