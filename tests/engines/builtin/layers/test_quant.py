"""Weight-only quantized linear layers (issues 5, 17): INT8 per-channel and INT4 group-wise,
with a float (Q4_1-like) or an integer zero point.

Round trips stay within the half-step bound of each scheme, the float scheme re-quantizes
Q4_1-style weights exactly, the packed CPU kernels agree with a float64
dequantize-then-matmul reference, the engine generates with either method, the stored bytes
shrink as the formats promise, a group size that does not divide a layer is fitted per layer
(or falls back to INT8 where none divides), and describe() says which.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dequantized_twin import dequantized_twin_tokens

from engines.base import ConfigError
from engines.builtin import LLM, EngineConfig, SamplingParams
from engines.builtin.layers import make_linear_method
from engines.builtin.layers.fp8 import Fp8Method
from engines.builtin.layers.linear import DenseMethod, Linear
from engines.builtin.layers.quant import (
    Int4Method,
    Int8Fallback,
    Int8Method,
    int4_group_size,
    quantize_int4,
)
from engines.builtin.native import quant as native_quant

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


@pytest.mark.parametrize("zero_point", ["float", "int"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("out", [64, 40])  # 40: not packable (N % 16), plain-nibble path
def test_int4_round_trip_within_half_a_step(group: int, out: int, zero_point: str) -> None:
    method = Int4Method(group, zero_point)
    layer, w = make_layer(method, out, 256)
    assert layer.int4_packed == (out % 16 == 0) and layer.group_size == group
    scale = layer.scales_and_zeros[..., 0].T.repeat_interleave(group, dim=1)  # [out, in]
    err = (w - method.dequantize(layer)).abs()
    assert (err <= scale / 2 + EPS).all()
    # and the integer grid is really 16 levels: (deq - zero_f) / scale + 8 in [0, 15]
    zero = layer.scales_and_zeros[..., 1].T.repeat_interleave(group, dim=1)
    levels = (method.dequantize(layer) - zero) / scale + 8
    assert torch.allclose(levels, levels.round(), atol=1e-3)
    assert levels.min() >= -1e-3 and levels.max() <= 15 + 1e-3
    if zero_point == "float":  # each group's min and max are grid points: levels 0 and 15
        groups = levels.reshape(out, -1, group)
        assert torch.allclose(groups.amin(-1), torch.zeros(()), atol=1e-3)
        assert torch.allclose(groups.amax(-1), torch.full((), 15.0), atol=1e-3)


def test_float_zero_point_is_closer_on_groups_away_from_zero() -> None:
    """A group of all-positive weights: the integer scheme widens the range to 0 and spends
    levels there; the float minimum spends all 16 on the group's own range."""
    w = 1.0 + 0.1 * torch.rand(16, 64, generator=torch.Generator().manual_seed(0))
    errors = {}
    for zero_point in ("float", "int"):
        method = Int4Method(32, zero_point)
        layer = Linear(64, 16, method)
        layer.load(w)
        errors[zero_point] = float((w - method.dequantize(layer)).abs().max())
    # float: half a step of 0.1 / 15; int: half a step of 1.1 / 15
    assert errors["float"] <= 0.1 / 30 + EPS < 1.1 / 30 - EPS
    assert errors["int"] > 0.1 / 30


def q4_1_weight(out: int, inn: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(w fp32, q) as llama.cpp's Q4_1 stores them: blocks of 32 with an fp16 scale d and
    minimum m, every block spanning all 16 levels (its min is level 0, its max level 15), and
    w = q * d + m computed in fp32 (as gguf's dequantize does)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = out * inn // 32
    q = torch.randint(0, 16, (blocks, 32), generator=gen)
    q[:, 0], q[:, 1] = 0, 15  # the extremes, then shuffled within the block
    q = torch.gather(q, 1, torch.argsort(torch.rand(blocks, 32, generator=gen), dim=1))
    d = (0.002 + 0.01 * torch.rand(blocks, 1, generator=gen)).half().float()
    m = (-d * (4 + 8 * torch.rand(blocks, 1, generator=gen))).half().float()
    return (q * d + m).reshape(out, inn), q.reshape(out, inn)


def test_requantizing_q4_1_weights_is_lossless() -> None:
    w, q_orig = q4_1_weight(64, 256)
    step = w.reshape(-1, 32).amax(-1) - w.reshape(-1, 32).amin(-1)  # 15 d per block
    for dtype, bound in ((torch.float32, 1e-6), (torch.float16, 2**-10), (torch.bfloat16, 2**-7)):
        q, sz = quantize_int4(w, 32, "float", dtype)
        assert torch.equal(q, q_orig)  # the same levels: only scale and zero round
        scale = sz[..., 0].float().T.repeat_interleave(32, dim=1)
        zero = sz[..., 1].float().T.repeat_interleave(32, dim=1)
        err = ((q - 8) * scale + zero - w).abs().reshape(-1, 32).amax(-1)
        # the storage dtype's rounding of scale and zero, as a fraction of a level (d = step/15)
        assert (err <= bound * step).all(), (dtype, float((err / (step / 15)).max()))
    # and the layer (packed CPU kernel layout) dequantizes to the very same weight in fp32
    method = Int4Method(32, "float")
    layer = Linear(256, 64, method)
    layer.load(w)
    assert (method.dequantize(layer) - w).abs().max() <= 1e-6


def test_symmetric_requantizes_q4_0_weights_and_stays_within_a_step() -> None:
    """Q4_0-style weights ((q - 8) d per block of 32, the peak at level 0) come back exactly;
    on any weights the error is within half a step except at the clamped end (level 15 is
    7/8 of the peak on the other side), within one step there."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (16, 64), generator=gen)
    q[:, ::32] = 0  # each block's peak
    d = -(torch.rand(16, 2, generator=gen) + 0.5) / 8
    w = ((q - 8).float().reshape(16, 2, 32) * d[..., None]).reshape(16, 64)
    got, sz = quantize_int4(w, 32, "symmetric", torch.float32)
    assert torch.equal(got, q.to(torch.int32)) and not sz[..., 1].any()  # no zero point
    for native in (False, True):
        method = Int4Method(32, "symmetric", native_reason=None if native else "torch")
        layer, w = make_layer(method, 48, 128)
        step = layer.scales.abs() if native else layer.scales_and_zeros[..., 0].T.abs()
        err = (method.dequantize(layer) - w).abs().reshape(48, 4, 32).amax(-1)
        assert (err <= step + EPS).all()
        assert float((err / step).median()) <= 0.5 + EPS


def test_integer_zero_point_does_not_requantize_q4_1_exactly() -> None:
    """Why the float scheme exists: the integer zero point moves Q4_1's grid."""
    w, _ = q4_1_weight(64, 256)
    method = Int4Method(32, "int")
    layer = Linear(256, 64, method)
    layer.load(w)
    d = (w.reshape(-1, 32).amax(-1) - w.reshape(-1, 32).amin(-1)) / 15
    err = (method.dequantize(layer) - w).abs().reshape(-1, 32).amax(-1)
    assert float((err / d).max()) > 0.1


# Kernel vs a float64 reference (the stored weight dequantized, x and y in float64): float32 is
# exact up to summation order (1e-4 of the output's scale); bfloat16 rounds x and the output to
# 8 mantissa bits, so allow 2% of the output's max |y|.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("method", "out", "inn"),
    [
        (Int8Method(), 64, 128),
        (Int8Method(), 96, 200),
        (Int4Method(32), 64, 128),
        (Int4Method(32, "int"), 64, 128),
        (Int4Method(64), 48, 256),
        (Int4Method(64, "int"), 48, 256),
        (Int4Method(128), 32, 384),
        (Int4Method(128), 32, 576),  # 576 = 9 x 64: the layer gets group 64
        (Int4Method(32), 24, 64),  # not packable: dequantize path
        (Int4Method(32, "int"), 24, 64),
    ],
)
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_kernels_match_the_dequantized_reference(
    method, out: int, inn: int, dtype: torch.dtype, native: bool
) -> None:
    method = copy.copy(method)  # the parameter is shared by every case
    if native:
        method.native_reason = None  # the engine's C kernels (torch's when not set)
    layer, _ = make_layer(method, out, inn, dtype=dtype, bias=True)
    assert layer.native == native
    x = torch.randn(3, 5, inn).to(dtype)
    y = layer(x)
    assert y.shape == (3, 5, out) and y.dtype == dtype
    ref = x.double() @ method.dequantize(layer).double().T + layer.bias.double()
    assert (y.double() - ref).abs().max() <= TOL[dtype] * ref.abs().max()


def test_dequantize_reads_the_packed_layout_back() -> None:
    """The packed layer's dequantize (read back through the kernel) equals the plain
    arithmetic on quantize_int4's q, scales and zeros, in both schemes."""
    for zero_point in ("float", "int"):
        method = Int4Method(64, zero_point)
        layer, w = make_layer(method, 32, 128)
        assert layer.int4_packed
        q, sz = quantize_int4(w, 64, zero_point, torch.float32)
        scale = sz[..., 0].T.repeat_interleave(64, dim=1)
        zero = sz[..., 1].T.repeat_interleave(64, dim=1)
        expected = (q.double() - 8) * scale.double() + zero.double()
        assert (method.dequantize(layer).double() - expected).abs().max() <= 1e-6


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
    assert method.zero_point == "float"  # the default: it wins on quality (docs/quality.md)
    method = make_linear_method("int4", 32, zero_point="int")
    assert isinstance(method, Int4Method) and method.zero_point == "int"
    with pytest.raises(
        ValueError,
        match=r"engine.quantization_zero_point: 'fp' is invalid; allowed: float\|int\|symmetric",
    ):
        make_linear_method("int4", 32, zero_point="fp")
    with pytest.raises(
        ValueError,
        match=r"engine.quantization: 'fp4' is invalid; allowed: .*none\|int8\|int4",
    ):
        make_linear_method("fp4")
    assert isinstance(make_linear_method("fp8"), Fp8Method)


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
            quantization_group_size=32,
            quantization_zero_point="int",
            model_overrides={"intermediate_size": 192},
        ),
        dict(
            quantization="int4",
            quantization_group_size=64,
            quantize_lm_head=True,
            lm_head_quantization="same",
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
    # quantized layers take an INT8 head unless asked otherwise (lm_head_quantization=same)
    same = options.get("lm_head_quantization") == "same"
    assert head.method.name == (options["quantization"] if same else "int8")
    assert all(
        m.method.name == options["quantization"]
        for n, m in model.linear_layers().items()
        if n.startswith("layers.")
    )


def test_group_size_per_layer() -> None:
    # the largest allowed group <= the one asked that divides in_features; None if none does
    assert int4_group_size(576, 128) == 64 and int4_group_size(576, 64) == 64
    assert int4_group_size(576, 32) == 32 and int4_group_size(1536, 128) == 128
    assert int4_group_size(96, 128) == 32 and int4_group_size(176, 128) is None
    layer = Linear(576, 16, Int4Method(128))
    layer.load(torch.randn(16, 576))
    assert layer.group_size == 64 and layer.scales_and_zeros.shape == (9, 16, 2)
    assert layer.method.describe(layer).startswith(
        "int4 g64 zero_point=float; kernel torch: _weight_int4pack_mm_for_cpu (engine C "
        "kernels off: not requested"
    )


def test_int4_where_no_group_divides_falls_back_to_int8_and_says_so(make_tiny) -> None:
    # tiny's intermediate_size is 176 = 16 x 11: down_proj's input fits no int4 group size;
    # hidden 64 takes group 64 when 128 is asked.
    llm = make_tiny(quantization="int4", quantization_group_size=128)
    model = llm.engine.runner.model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down.method, Int8Fallback) and down.qweight.dtype == torch.int8
    methods = llm.engine.describe()["linear_methods"]
    kernel = "; kernel " + native_quant.describe_kernel(4)
    assert methods == {
        "layers.*.attn.qkv_proj": "int4 g64 zero_point=float" + kernel,
        "layers.*.attn.o_proj": "int4 g64 zero_point=float" + kernel,
        "layers.*.mlp.gate_up_proj": "int4 g64 zero_point=float" + kernel,
        "layers.*.mlp.down_proj": "int8 (int4 fallback: no int4 group size <= 128 of "
        "32|64|128 divides in_features=176); kernel " + native_quant.describe_kernel(8),
        "lm_head": "int8; kernel " + native_quant.describe_kernel(8),  # llama.cpp's Q8_0 head
    }
    assert kernel.startswith("; kernel native: <= 4 rows float FMA")
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == 12 for o in outs)


def test_config_validates_the_new_options() -> None:
    with pytest.raises(
        ConfigError,
        match=r"quantization_group_size: 48 is invalid; "
        r"allowed: 32\|64\|128",
    ):
        EngineConfig.from_dict({"quantization": "int4", "quantization_group_size": 48})
    with pytest.raises(ConfigError, match="quantize_lm_head"):
        EngineConfig.from_dict({"quantize_lm_head": "yes"})
    with pytest.raises(
        ConfigError,
        match=r"^engine.quantization_activations: 'int4' is invalid; allowed: float\|int8$",
    ):
        EngineConfig.from_dict({"quantization": "int4", "quantization_activations": "int4"})
    with pytest.raises(ConfigError, match="'int8' is for quantization=int4"):
        EngineConfig.from_dict({"quantization": "int8", "quantization_activations": "int8"})
    with pytest.raises(
        ConfigError,
        match=r"^engine.lm_head_quantization: 'int8' applies to a quantized LM head; set "
        r"engine.quantize_lm_head=true or null, or allowed here: auto\|same$",
    ):
        EngineConfig.from_dict(
            {"quantization": "int4", "quantize_lm_head": False, "lm_head_quantization": "int8"}
        )
    with pytest.raises(ConfigError, match=r"lm_head_quantization: 'int4' is invalid; allowed"):
        EngineConfig.from_dict({"quantize_lm_head": True, "lm_head_quantization": "int4"})
    # hostile pass 36: true with `same` beside dense layers kept the head dense, silently
    with pytest.raises(
        ConfigError,
        match=r"^engine.quantize_lm_head=true asks for a quantized LM head, but "
        r"engine.lm_head_quantization='same' takes the layers' method, and "
        r"quantization='none' keeps a float head dense: it would stay dense; set "
        r"lm_head_quantization=auto\|int8, or quantize_lm_head=null\|false$",
    ):
        EngineConfig.from_dict(
            {"quantization": "none", "quantize_lm_head": True, "lm_head_quantization": "same"}
        )
    # hostile pass 43: auto (a checkpoint's float head as it is stored) the same
    with pytest.raises(ConfigError, match=r"quantization='auto' keeps a float head dense"):
        EngineConfig.from_dict({"quantize_lm_head": True, "lm_head_quantization": "same"})
    none_same = {"quantization": "none", "lm_head_quantization": "same"}
    assert EngineConfig.from_dict(none_same).lm_head_method() == "none"
    with pytest.raises(ConfigError, match="native_decode_program"):
        EngineConfig.from_dict({"native_decode_program": 1})
    with pytest.raises(
        ConfigError,
        match=r"^engine.quantization_zero_point: 'asym' is invalid; "
        r"allowed: float\|int\|symmetric$",
    ):
        EngineConfig.from_dict({"quantization": "int4", "quantization_zero_point": "asym"})
    config = EngineConfig.from_dict({"quantization": "int4", "quantization_group_size": 32})
    assert config.quantization == "int4" and config.quantize_lm_head is None
    assert config.lm_head_method() == "int8"  # quantized layers, an INT8 head (llama.cpp's)
    assert EngineConfig.from_dict({"quantization": "int4"}).lm_head_method() == "int8"
    assert EngineConfig.from_dict({"quantization": "none"}).lm_head_method() == "none"
    # the default: the head as the checkpoint keeps it (a GGUF's Q8_0/Q6_K head stays so)
    assert EngineConfig.from_dict({}).lm_head_method() == "auto"
    assert EngineConfig.from_dict({"quantize_lm_head": True}).lm_head_method() == "int8"
    same = {"quantization": "int4", "lm_head_quantization": "same"}
    assert EngineConfig.from_dict(same).lm_head_method() == "int4"
    assert EngineConfig.from_dict({**same, "quantize_lm_head": False}).lm_head_method() == "none"
    assert config.quantization_zero_point == "float"


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
            quantize_lm_head=False,  # the layers' bytes alone
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


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize(
    "options",
    [
        dict(quantization="int8", quantize_lm_head=True),
        dict(
            quantization="int4",
            quantization_group_size=32,
            quantize_lm_head=True,
            lm_head_quantization="same",
        ),
        dict(quantization="int4", quantization_group_size=128, quantization_zero_point="int"),
        dict(quantization="int4", quantization_group_size=64, quantization_zero_point="symmetric"),
        dict(
            quantization="int4",
            quantization_group_size=32,
            quantize_lm_head=True,
            lm_head_quantization="int8",
        ),
    ],
    ids=["int8", "int4-g32", "int4-g128-int", "int4-g64-symmetric", "int4-g32-int8-head"],
)
def test_greedy_tokens_equal_the_dequantized_float32_model(preset: str, options) -> None:
    """The engine's kernels compute what the weights they store represent: its greedy tokens
    are the dequantize-then-float32 model's, through prefill (tiles) and decode (rows)."""
    overrides = {"num_layers": 2} if preset == "small" else {"intermediate_size": 192}
    llm = LLM(
        preset,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        model_overrides=overrides,
        **options,
    )
    quantized = [
        m for m in llm.engine.runner.model.linear_layers().values() if m.method.name != "none"
    ]
    assert quantized and all(m.native for m in quantized)  # the engine's C kernels
    head = llm.engine.runner.model.lm_head
    # quantized layers, an INT8 head unless lm_head_quantization=same
    same = options.get("lm_head_quantization") == "same"
    assert head is not None and head.method.name == (options["quantization"] if same else "int8")
    prompts = [list(range(3, 40)), [9, 8, 7], list(range(100, 120))]  # prefill > 16 rows too
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    assert dequantized_twin_tokens(llm, prompts, params) == expected
