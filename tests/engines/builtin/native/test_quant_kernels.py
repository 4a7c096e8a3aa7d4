"""The engine's INT8 / INT8-blocks / INT5-blocks / grouped INT8 / INT4 linear kernels
(quant_kernels.c, native/quant.py) against float64 dequantize-then-matmul: every vector width
this machine runs, the rows (decode) and tile (prefill) kernels, odd shapes, every group size,
1-4 threads; INT8 activations against their own fake-quantized reference; results
bit-identical whatever rows share a call."""

from __future__ import annotations

import itertools

import pytest
import torch

from engines.builtin import native
from engines.builtin.native import quant as native_quant

PATHS = native_quant.paths()  # e.g. portable, vec4, vec8 here; vec16 on AVX-512 machines
ROW_COUNTS = (1, 2, 3, 5, 16, 17, 130, 300)  # tiles in passes of 256 rows above 256


def kernels(rows: int) -> tuple[int, ...]:
    """`max_rows` values that run each kernel on `rows` rows: the rows kernels (up to 16 rows,
    past every format's crossover) and the tile kernel (0)."""
    return (16, 0) if rows <= 16 else (0,)


def random_int4(out_features: int, in_features: int, group: int, gen: torch.Generator):
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    groups = in_features // group
    scales = torch.rand(out_features, groups, generator=gen) * 0.1 + 1e-3
    mins = -torch.rand(out_features, groups, generator=gen) * 0.8
    w = q.double().reshape(out_features, groups, group) * scales.double()[..., None]
    w = (w + mins.double()[..., None]).reshape(out_features, in_features)
    return native_quant.pack_int4(q), scales, mins, w


def random_int8(out_features: int, in_features: int, gen: torch.Generator):
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    return q, scales, q.double() * scales.double()[:, None]


def fake_quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The INT8 activations the kernel multiplies: per block of 32, round(x 127 / max|x|)
    (half to even) times max|x| / 127, all in float32 as the kernel computes them."""
    rows, width = x.shape
    blocks = x.reshape(rows, width // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv).double() * (amax / 127.0).double()).reshape(rows, width)


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(got.double() / scale, expected / scale, rtol=0, atol=3e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernels_match_float64_dequantize_then_matmul(path: str, group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    # N not a multiple of any register block or of the threads' runs of rows; K from one group
    for in_features, out_features in [(group, 3), (2 * group, 17), (4 * group, 97)]:
        nibbles, scales, mins, w = random_int4(out_features, in_features, group, gen)
        bias = torch.randn(out_features, generator=gen)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, in_features, generator=gen)
            expected = x.double() @ w.T + bias.double()
            for threads, max_rows in itertools.product((1, 3), kernels(rows)):
                torch.set_num_threads(threads)
                got = native_quant.int4_linear(
                    x, nibbles, scales, mins, group, bias, path=path, max_rows=max_rows
                )
                assert_matches(got, expected)
    torch.set_num_threads(2)


@pytest.mark.parametrize("path", PATHS)
def test_int8_kernels_match_float64_dequantize_then_matmul(path: str) -> None:
    gen = torch.Generator().manual_seed(8)
    for in_features, out_features in [(1, 1), (7, 5), (37, 33), (200, 97)]:  # odd K too
        q, scales, w = random_int8(out_features, in_features, gen)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, in_features, generator=gen)
            for threads, max_rows in itertools.product((1, 4), kernels(rows)):
                torch.set_num_threads(threads)
                got = native_quant.int8_linear(x, q, scales, path=path, max_rows=max_rows)
                assert_matches(got, x.double() @ w.T)
            with_bias = native_quant.int8_linear(x, q, scales, torch.ones(out_features))
            assert_matches(with_bias, x.double() @ w.T + 1.0)
    torch.set_num_threads(2)


def random_fp8(out_features: int, in_features: int, gen: torch.Generator):
    """Every e4m3 byte but the two NaNs, subnormals and the largest values included, in random
    places, and a float32 scale a row."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    picks = torch.randint(0, len(codes), (out_features, in_features), generator=gen)
    q = codes[picks].view(torch.float8_e4m3fn)
    scales = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    return q, scales, q.double() * scales.double()[:, None]


@pytest.mark.parametrize("path", PATHS)
def test_fp8_kernels_match_float64_dequantize_then_matmul(path: str) -> None:
    """torch's own float8_e4m3fn -> float64 conversion is the reference of the widening."""
    gen = torch.Generator().manual_seed(18)
    for in_features, out_features in [(1, 1), (7, 5), (37, 33), (256, 97)]:  # odd K too
        q, scales, w = random_fp8(out_features, in_features, gen)
        bias = torch.randn(out_features, generator=gen)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, in_features, generator=gen)
            for threads, max_rows in itertools.product((1, 3), kernels(rows)):
                torch.set_num_threads(threads)
                got = native_quant.fp8_linear(x, q, scales, bias, path=path, max_rows=max_rows)
                assert_matches(got, x.double() @ w.T + bias.double())
    torch.set_num_threads(2)


@pytest.mark.parametrize("path", native_quant.paths("int8"))
def test_int8_activations_match_their_fake_quantized_reference(path: str) -> None:
    gen = torch.Generator().manual_seed(5)
    for group, in_features, out_features in [(32, 64, 3), (64, 576, 97), (128, 256, 40)]:
        nibbles, scales, mins, w = random_int4(out_features, in_features, group, gen)
        for rows in (1, 2, 4, 5, 16):
            x = torch.randn(rows, in_features, generator=gen)
            x[0, 32:64] = 0.0  # an all-zero block: scale 0, no division by it
            got = native_quant.int4_linear(
                x, nibbles, scales, mins, group, activations="int8", path=path, max_rows=16
            )
            assert_matches(got, fake_quantized_activations(x) @ w.T)
            # and near the weight-only product: the activations' rounding, not a wrong sum
            exact = x.double() @ w.T
            assert (got.double() - exact).abs().max() < 0.05 * exact.abs().max()


def random_int8g(out_features: int, in_features: int, group: int, gen: torch.Generator):
    """Grouped INT8 with levels over the whole byte (Q8_0's q + 128 reaches 255)."""
    q = torch.randint(0, 256, (out_features, in_features), generator=gen, dtype=torch.uint8)
    groups = in_features // group
    scales = torch.rand(out_features, groups, generator=gen) * 0.01 + 1e-4
    mins = -torch.rand(out_features, groups, generator=gen) * 1.3
    w = q.double().reshape(out_features, groups, group) * scales.double()[..., None]
    w = (w + mins.double()[..., None]).reshape(out_features, in_features)
    return q, scales, mins, w


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", [16, 32])
def test_grouped_int8_kernels_match_float64_dequantize_then_matmul(path: str, group: int) -> None:
    gen = torch.Generator().manual_seed(group + 1)
    # K from one group to SmolLM2's widths; 48 and 80: an odd number of 16-chunks
    for in_features, out_features in [(group, 3), (48, 5), (80, 17), (576, 97), (1536, 9)]:
        if in_features % group:
            continue
        q, scales, mins, w = random_int8g(out_features, in_features, group, gen)
        bias = torch.randn(out_features, generator=gen)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, in_features, generator=gen)
            expected = x.double() @ w.T + bias.double()
            for threads, max_rows in itertools.product((1, 3), kernels(rows)):
                torch.set_num_threads(threads)
                got = native_quant.int8g_linear(
                    x, q, scales, mins, group, bias, path=path, max_rows=max_rows
                )
                assert_matches(got, expected)
    torch.set_num_threads(2)


@pytest.mark.parametrize("path", native_quant.paths("int8"))
@pytest.mark.parametrize("group", [16, 32])
def test_grouped_int8_with_int8_activations_match_their_reference(path: str, group: int) -> None:
    gen = torch.Generator().manual_seed(7)
    for in_features, out_features in [(32, 3), (96, 7), (576, 97), (1536, 5)]:
        q, scales, mins, w = random_int8g(out_features, in_features, group, gen)
        for rows in (1, 2, 3, 4, 5, 16):
            x = torch.randn(rows, in_features, generator=gen)
            x[0, :32] = 0.0  # an all-zero block
            got = native_quant.int8g_linear(
                x, q, scales, mins, group, activations="int8", path=path, max_rows=16
            )
            assert_matches(got, fake_quantized_activations(x) @ w.T)
    with pytest.raises(ValueError, match="in_features % 32"):
        q, scales, mins, _ = random_int8g(3, 48, 16, gen)
        native_quant.int8g_linear(torch.randn(1, 48), q, scales, mins, 16, activations="int8")


def random_int8b(out_features: int, in_features: int, gen: torch.Generator):
    """INT8 blocks over the whole int8 range, -128 included (Q8_0 stores it)."""
    q = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    d = (torch.rand(out_features, in_features // 32, generator=gen) * 0.01 + 1e-4).half()
    d[0, 0] = 0.0  # an all-zero block
    w = q.double().reshape(out_features, -1, 32) * d.double()[..., None]
    return q, d, w.reshape(out_features, in_features)


@pytest.mark.parametrize("path", PATHS)
def test_int8_blocks_kernels_match_float64_dequantize_then_matmul(path: str) -> None:
    gen = torch.Generator().manual_seed(11)
    for in_features, out_features in [(32, 3), (96, 5), (576, 97), (1536, 9)]:  # odd blocks too
        q, d, w = random_int8b(out_features, in_features, gen)
        bias = torch.randn(out_features, generator=gen)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, in_features, generator=gen)
            expected = x.double() @ w.T + bias.double()
            for threads, max_rows in itertools.product((1, 3), kernels(rows)):
                torch.set_num_threads(threads)
                got = native_quant.int8b_linear(x, q, d, bias, path=path, max_rows=max_rows)
                assert_matches(got, expected)
    torch.set_num_threads(2)


@pytest.mark.parametrize("path", native_quant.paths("int8"))
def test_int8_blocks_with_int8_activations_match_their_reference(path: str) -> None:
    gen = torch.Generator().manual_seed(12)
    for in_features, out_features in [(32, 3), (96, 7), (576, 97), (1536, 5)]:
        q, d, w = random_int8b(out_features, in_features, gen)
        for rows in (1, 2, 3, 4, 5, 16):
            x = torch.randn(rows, in_features, generator=gen)
            x[0, :32] = 0.0
            got = native_quant.int8b_linear(x, q, d, activations="int8", path=path, max_rows=16)
            assert_matches(got, fake_quantized_activations(x) @ w.T)
    with pytest.raises(ValueError, match="in_features=48 is not a multiple of 32"):
        native_quant.int8b_linear(torch.randn(1, 48), q[:, :48], d[:, :1])
    with pytest.raises(ValueError, match="int8b_linear d"):
        native_quant.int8b_linear(torch.randn(1, 1536), q, d.float())


def random_int5(out_features: int, in_features: int, gen: torch.Generator):
    q = torch.randint(0, 32, (out_features, in_features), generator=gen, dtype=torch.uint8)
    nibbles, fifth = native_quant.pack_int5(q)
    assert torch.equal(native_quant.unpack_int5(nibbles, fifth), q)
    d = (torch.rand(out_features, in_features // 32, generator=gen) * 0.01 + 1e-4).half()
    m = (-torch.rand(out_features, in_features // 32, generator=gen) * 0.2).half()
    w = q.double().reshape(out_features, -1, 32) * d.double()[..., None] + m.double()[..., None]
    return nibbles, fifth, d, m, w.reshape(out_features, in_features)


@pytest.mark.parametrize("path", PATHS)
def test_int5_blocks_kernels_match_float64_dequantize_then_matmul(path: str) -> None:
    gen = torch.Generator().manual_seed(13)
    for in_features, out_features in [(32, 3), (96, 5), (576, 97), (1536, 9)]:
        nibbles, fifth, d, m, w = random_int5(out_features, in_features, gen)
        bias = torch.randn(out_features, generator=gen)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, in_features, generator=gen)
            expected = x.double() @ w.T + bias.double()
            for threads, max_rows in itertools.product((1, 3), kernels(rows)):
                torch.set_num_threads(threads)
                got = native_quant.int5_linear(
                    x, nibbles, fifth, d, m, bias, path=path, max_rows=max_rows
                )
                assert_matches(got, expected)
    torch.set_num_threads(2)


@pytest.mark.parametrize("path", native_quant.paths("int8"))
def test_int5_blocks_with_int8_activations_match_their_reference(path: str) -> None:
    gen = torch.Generator().manual_seed(14)
    for in_features, out_features in [(32, 3), (96, 7), (576, 97), (1536, 5)]:
        nibbles, fifth, d, m, w = random_int5(out_features, in_features, gen)
        for rows in (1, 2, 3, 4, 5, 16):
            x = torch.randn(rows, in_features, generator=gen)
            x[0, :32] = 0.0
            got = native_quant.int5_linear(
                x, nibbles, fifth, d, m, activations="int8", path=path, max_rows=16
            )
            assert_matches(got, fake_quantized_activations(x) @ w.T)
    with pytest.raises(ValueError, match="int5_linear fifth bits"):
        native_quant.int5_linear(torch.randn(1, 1536), nibbles, fifth.long(), d, m)


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_rows_are_bit_identical_whatever_rows_share_the_call(activations: str) -> None:
    """Batch invariance: a request's logits must not depend on its neighbours in a decode
    batch. Within each kernel (rows up to the format's crossover, or tiles above) every row is
    summed in the same order whatever the other rows are."""
    gen = torch.Generator().manual_seed(3)
    nibbles, scales, mins, _ = random_int4(96, 256, 32, gen)
    q8, s8, _ = random_int8(96, 256, gen)

    def int4(rows: torch.Tensor) -> torch.Tensor:
        return native_quant.int4_linear(rows, nibbles, scales, mins, 32, activations=activations)

    def int8(rows: torch.Tensor) -> torch.Tensor:
        return native_quant.int8_linear(rows, q8, s8)

    qg, sg, mg, _ = random_int8g(96, 256, 16, gen)

    def int8g(rows: torch.Tensor) -> torch.Tensor:
        return native_quant.int8g_linear(rows, qg, sg, mg, 16, activations=activations)

    qb, db, _ = random_int8b(96, 256, gen)

    def int8b(rows: torch.Tensor) -> torch.Tensor:
        return native_quant.int8b_linear(rows, qb, db, activations=activations)

    n5, f5, d5, m5, _ = random_int5(96, 256, gen)

    def int5(rows: torch.Tensor) -> torch.Tensor:
        return native_quant.int5_linear(rows, n5, f5, d5, m5, activations=activations)

    qf, sf, _ = random_fp8(96, 256, gen)

    def fp8(rows: torch.Tensor) -> torch.Tensor:
        return native_quant.fp8_linear(rows, qf, sf)

    crossovers = [
        (fp8, native_quant.rows_max(native_quant.FP8)),
        (int5, native_quant.rows_max(native_quant.INT5_BLOCKS, activations)),
        (int8b, native_quant.rows_max(native_quant.INT8_BLOCKS, activations)),
        (int4, native_quant.rows_max(4, activations)),
        (int8, native_quant.rows_max(8)),
        (int8g, native_quant.rows_max(native_quant.GROUPED_INT8, activations)),
    ]
    for linear, rows_max in crossovers:
        x = torch.randn(rows_max, 256, generator=gen)
        whole = linear(x)
        for start, stop in [(0, 1), (1, 2), (rows_max - 3, rows_max - 1), (1, rows_max)]:
            assert torch.equal(linear(x[start:stop]), whole[start:stop])
        tall = torch.randn(200, 256, generator=gen)  # the tile kernel: any split above
        whole = linear(tall)
        assert torch.equal(linear(tall[50:90]), whole[50:90])


def test_bf16_and_fp16_inputs_compute_in_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    nibbles, scales, mins, w = random_int4(48, 128, 64, gen)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(3, 128, generator=gen).to(dtype)
        got = native_quant.int4_linear(x, nibbles, scales, mins, 64)
        assert got.dtype == dtype
        expected = x.double() @ w.T
        assert (got.double() - expected).abs().max() <= 0.01 * expected.abs().max()


def test_pack_and_unpack_int4_round_trip() -> None:
    q = torch.randint(0, 16, (5, 96), dtype=torch.int32)
    packed = native_quant.pack_int4(q)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    # llama.cpp's order: byte j of a block holds inputs j (low bits) and 16 + j (high bits)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 16]) << 4)
    assert torch.equal(native_quant.unpack_int4(packed), q.to(torch.uint8))


def test_bad_arguments_name_the_problem() -> None:
    nibbles, scales, mins, _ = random_int4(8, 64, 32, torch.Generator().manual_seed(0))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size=48"):
        native_quant.int4_linear(x, nibbles, scales, mins, 48)
    with pytest.raises(ValueError, match=r"activations: 'int4'; allowed: float\|int8"):
        native_quant.int4_linear(x, nibbles, scales, mins, 32, activations="int4")
    with pytest.raises(ValueError, match="path: 'vec64' is not available"):
        native_quant.int4_linear(x, nibbles, scales, mins, 32, path="vec64")
    with pytest.raises(ValueError, match=r"x must be a CPU \[rows, 64\]"):
        native_quant.int4_linear(torch.randn(2, 32), nibbles, scales, mins, 32)
    with pytest.raises(ValueError, match="int4_linear scales"):
        native_quant.int4_linear(x, nibbles, scales.double(), mins, 32)
    with pytest.raises(ValueError, match="pack_int4: in_features=40"):
        native_quant.pack_int4(torch.zeros(2, 40, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"fp8_linear q: expected a contiguous CPU torch\.float8"):
        native_quant.fp8_linear(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))


def test_every_path_the_build_reports_is_one_this_cpu_runs() -> None:
    widest = native.layout().isa
    expected = {"avx512": "vec16", "avx2": "vec8", "avx": "vec8", "portable": "vec4"}[widest]
    assert native_quant.widest_path() == expected
    assert PATHS[0] == "portable" and "vec4" in PATHS


@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("rows", [5, 40])  # the rows kernels and the tile kernel
def test_a_non_finite_input_row_stays_in_its_row(activations: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(9)
    nibbles, scales, mins, _ = random_int4(24, 64, 32, gen)
    q8, s8, _ = random_int8(24, 64, gen)
    x = torch.randn(rows, 64, generator=gen)
    x[1, 3], x[3, 40] = float("nan"), float("inf")
    y4 = native_quant.int4_linear(x, nibbles, scales, mins, 32, activations=activations)
    y8 = native_quant.int8_linear(x, q8, s8)
    finite = [r for r in range(rows) if r not in (1, 3)]
    for y in (y4, y8):
        assert not y[1].isfinite().any() and not y[3].isfinite().any()
        assert y[finite].isfinite().all()


def test_the_structs_c_reads_are_refused_where_a_kernel_would_misread_them() -> None:
    """The checks the experts' entry point runs on each LinearWeights before C reads it."""
    check = native._check_linear_weights
    weight = native.LinearWeights
    some = torch.zeros(1).data_ptr()
    with pytest.raises(ValueError, match=r"kind: 11 is invalid; allowed: 0\.\.10"):
        check(weight(11, some, some, some, None, 64, 4, 32, 8))
    with pytest.raises(ValueError, match="NULL weight, scale"):
        check(weight(native.LINEAR_FP8, some, None, None, None, 64, 4, 0, 8))
    check(weight(native.LINEAR_FP8, some, some, None, None, 64, 4, 0, 8))  # no minimum: fine
    with pytest.raises(ValueError, match="INT8 activations: a multiple of 32"):
        check(weight(native.LINEAR_INT8G_A8, some, some, some, None, 48, 4, 16, 8))
    with pytest.raises(ValueError, match=r"grouped INT8: 16\|32"):
        check(weight(native.LINEAR_INT8G, some, some, some, None, 96, 4, 48, 8))
    with pytest.raises(ValueError, match="INT8/INT5 blocks: 32"):
        check(weight(native.LINEAR_INT8B, some, some, None, None, 64, 4, 16, 8))
    with pytest.raises(ValueError, match="NULL bits pointer"):
        check(weight(native.LINEAR_INT5B, some, some, some, None, 64, 4, 32, 8))
    check(weight(native.LINEAR_INT5B, some, some, some, None, 64, 4, 32, 8, some))  # fine
