"""The engine's C kernels (engines/builtin/native) against torch references, and how the
engine picks them: `auto` takes them on CPU where they build and falls back to torch's
otherwise."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest
import torch
from attention_batches import make_batch

from engines.builtin import LLM, SamplingParams, native
from engines.builtin.attention import (
    DenseAttention,
    make_attention,
    reference_kernel,
    resolve_attention,
)
from engines.builtin.layers.rotary import RotaryEmbedding, apply_rotary
from engines.builtin.native import cache as native_cache
from engines.builtin.native import quant as native_quant


def test_the_kernels_build_here() -> None:
    # CI machines have a C compiler; if this fails the engine silently runs the sdpa path
    assert native.load() is not None, native.reason()
    engine = LLM("tiny", dtype="float32").engine
    assert engine.describe()["native_kernels_isa"] == native.layout().isa
    assert native.layout().isa in {"avx512", "avx2", "avx", "portable"}


def reference_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    rows = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        first = 0 if window is None else max(0, n - window)
        blocks = tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[first:n].repeat_interleave(heads // kv_heads, 1)
        v = v_cache[blocks].flatten(0, 1)[first:n].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k.double()) * scale
        rows.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v.double()))
    return torch.stack(rows).float()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 4, 16), (8, 2, 64), (6, 1, 32), (12, 12, 64)]
)
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize(
    ("lengths", "threads"),
    [
        ([1, 8, 9, 31, 3, 64, 17], 1),
        ([1, 8, 9, 31, 3, 64, 17], 2),
        ([17], 4),
        ([5, 40], 4),  # fewer sequences than 2 x threads: runs of KV heads per task
    ],
)
def test_decode_attention_matches_torch(
    heads: int, kv_heads: int, dim: int, window: int | None, lengths: list[int], threads: int
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    block_size, num_blocks = 8, 64
    lens = torch.tensor(lengths, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    # every sequence's blocks scattered over the pool, out of order
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * 8].view(len(lens), 8)
    tables = tables.int().contiguous()
    # q as the model has it: a view into [T, q_heads + kv_heads, d], rows strided
    qk = torch.randn(len(lens), heads + kv_heads, dim, generator=gen)
    q = qk[:, :heads]
    scale = dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native.decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    finally:
        torch.set_num_threads(before)
    expected = reference_decode(q, k_cache, v_cache, tables, lens, scale, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 200])
def test_decode_attention_splits_long_contexts_and_merges_them_exactly_alike(window) -> None:
    """Past 128 positions a sequence is split into tasks of 128 (split-K) whose partial
    results the last one merges: torch's answer, and the same bits at every thread count."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    lengths = [129, 300, 1, 128, 257, 0, 513]
    gen = torch.Generator().manual_seed(36)
    blocks_per_seq = 33
    num_blocks = blocks_per_seq * len(lengths)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(len(lengths), blocks_per_seq)
    tables, lens = tables.int().contiguous(), torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    scale = dim**-0.5
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(native.decode_attention(q, k_cache, v_cache, tables, lens, scale, window))
    finally:
        torch.set_num_threads(before)
    expected = reference_decode(q, k_cache, v_cache, tables, lens, scale, window)
    expected[lens == 0] = 0.0  # no key: the kernel's zeros (the reference's softmax of none)
    torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def reference_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Each prompt attends to its own keys: causal, within the window, in float64."""
    groups, rows, start = q.shape[1] // k.shape[1], [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].double() for t in (q, k, v))
        scores = torch.einsum("ihd,jhd->hij", qs, ks.repeat_interleave(groups, 1)) * scale
        pos = torch.arange(n)
        visible = pos[None, :] <= pos[:, None]
        if window is not None:
            visible &= pos[None, :] > pos[:, None] - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        rows.append(torch.einsum("hij,jhd->ihd", probs, vs.repeat_interleave(groups, 1)))
        start += n
    return torch.cat(rows).float()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(12, 12, 64), (8, 2, 64), (6, 1, 32), (4, 4, 80)]
)  # 80: a partial panel
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize(
    ("lengths", "threads"),
    [
        ([64, 130, 1, 7, 33], 1),
        ([64, 130, 1, 7, 33], 2),
        ([300], 4),  # fewer (prompt, KV head) pairs than 2 x threads: runs of query tiles per task
    ],
)
def test_prefill_attention_matches_torch(
    heads: int, kv_heads: int, dim: int, window: int | None, lengths: list[int], threads: int
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    tokens = sum(lengths)
    # q, k and v as the model has them: views into the fused QKV rows
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    q = q.view(tokens, heads, dim)
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    scale = dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native.prefill_attention(q, k, v, starts, scale, window)
    finally:
        torch.set_num_threads(before)
    expected = reference_prefill(q, k, v, lengths, scale, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_kernels_refuse_what_they_cannot_read() -> None:
    """Bad arguments raise, naming the problem; none reaches the C code (which would read or
    write out of bounds)."""
    cache = torch.zeros(2, 4, 1, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="exceeds the block tables"):
        native.decode_attention(
            torch.zeros(1, 2, 8),
            cache,
            cache,
            tables,
            torch.tensor([5], dtype=torch.int32),
            1.0,
            None,
        )
    with pytest.raises(ValueError, match="block id past the cache"):
        native.decode_attention(
            torch.zeros(1, 2, 8),
            cache,
            cache,
            torch.tensor([[2]], dtype=torch.int32),
            lens,
            1.0,
            None,
        )
    assert native.decode_attention(
        torch.zeros(0, 2, 8), cache, cache, tables[:0], lens[:0], 1.0, None
    ).shape == (0, 2, 8)
    with pytest.raises(ValueError, match="rms_norm"):
        native.rms_norm(torch.zeros(4, 8), torch.ones(8), 1e-6, torch.zeros(1, 8))
    with pytest.raises(ValueError, match="rms_norm"):
        native.rms_norm(torch.zeros(4, 8), torch.ones(3), 1e-6)
    with pytest.raises(ValueError, match="silu_and_mul"):
        native.silu_and_mul(torch.zeros(2, 7))
    table = torch.zeros(10, 8)
    qkv, kv = torch.zeros(2, 3 * 8), torch.zeros(16, 1, 8)
    with pytest.raises(ValueError, match="past the rotary table"):
        native.rope_and_cache(qkv, torch.tensor([3, 10]), table, 1, 1, 8, None, None, None)
    with pytest.raises(ValueError, match="slot past the cache"):
        native.rope_and_cache(
            qkv, torch.tensor([3, 4]), table, 1, 1, 8, kv, kv, torch.tensor([0, 16])
        )
    with pytest.raises(ValueError, match="rope_and_cache"):  # heads do not match the rows
        native.rope_and_cache(qkv, torch.tensor([3, 4]), table, 2, 1, 8, None, None, None)
    with pytest.raises(TypeError, match="float32"):
        native.decode_attention(
            torch.zeros(1, 2, 8, dtype=torch.float64), cache, cache, tables, lens, 1.0, None
        )
    with pytest.raises(ValueError, match="unsupported"):
        native.decode_attention(torch.zeros(1, 2, 8), cache, cache, tables.long(), lens, 1.0, None)
    with pytest.raises(ValueError, match="unsupported"):  # heads not a multiple of KV heads
        native.decode_attention(
            torch.zeros(1, 3, 8),
            torch.zeros(2, 4, 2, 8),
            torch.zeros(2, 4, 2, 8),
            tables,
            lens,
            1.0,
            None,
        )
    rows = torch.zeros(5, 2, 8)
    with pytest.raises(ValueError, match="starts must ascend from 0 to 5"):
        native.prefill_attention(
            rows, rows, rows, torch.tensor([0, 3, 2, 5], dtype=torch.int32), 1.0, None
        )
    with pytest.raises(ValueError, match="starts must ascend from 0 to 5"):  # rows left over
        native.prefill_attention(
            rows, rows, rows, torch.tensor([0, 4], dtype=torch.int32), 1.0, None
        )
    with pytest.raises(ValueError, match="prefill_attention starts"):
        native.prefill_attention(rows, rows, rows, torch.tensor([0, 5]), 1.0, None)
    with pytest.raises(ValueError, match="unsupported"):  # heads not a multiple of KV heads
        native.prefill_attention(
            torch.zeros(5, 3, 8), rows, rows, torch.tensor([0, 5], dtype=torch.int32), 1.0, None
        )
    with pytest.raises(ValueError, match="out must be a contiguous"):
        native.prefill_attention(
            rows,
            rows,
            rows,
            torch.tensor([0, 5], dtype=torch.int32),
            1.0,
            None,
            out=torch.zeros(4, 2, 8),
        )
    with pytest.raises(TypeError, match="float32"):
        native.prefill_attention(
            rows.double(), rows, rows, torch.tensor([0, 5], dtype=torch.int32), 1.0, None
        )


@pytest.mark.parametrize(
    ("seqs", "num_decodes", "kernel_runs"),
    [
        ([(1, 1), (45, 1), (33, 33), (5, 5), (70, 70)], 2, True),  # decodes and whole prompts
        ([(33, 33), (1, 1), (130, 130)], 0, True),  # whole prompts only
        ([(45, 1), (33, 33), (50, 17)], 1, False),  # a chunk on cached context: the sdpa way
    ],
)
@pytest.mark.parametrize("window", [None, 20])
def test_cpu_backend_matches_the_dense_path_on_mixed_steps(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    kernel_runs: bool,
    window: int | None,
    monkeypatch,
) -> None:
    q, k, v, cache, meta = make_batch(
        seqs, num_decodes, 16, 4, 2, 32, torch.float32, window, seed=len(seqs)
    )
    calls = []
    kernel = native.prefill_attention
    monkeypatch.setattr(
        native,
        "prefill_attention",
        lambda *args, **kwargs: calls.append(args[0].shape[0]) or kernel(*args, **kwargs),
    )
    out = make_attention("cpu")(q, k, v, cache, meta, 0.2)
    dense = DenseAttention("torch", reference_kernel)(q, k, v, cache, meta, 0.2)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    prompt_rows = sum(n for _, n in seqs[num_decodes:])
    assert calls == ([prompt_rows] if kernel_runs else [])


def test_auto_picks_the_kernel_on_cpu_and_sdpa_without_it(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_attention("auto", cpu) == "cpu"
    assert resolve_attention("auto", torch.device("meta")) == "sdpa"
    assert resolve_attention("torch", cpu) == "torch"
    # where the kernel would not run, auto says sdpa (describe() reports what runs)
    assert resolve_attention("auto", cpu, torch.bfloat16) == "sdpa"
    assert resolve_attention("auto", cpu, torch.float32, kv_cache_dtype="int8") == "sdpa"
    assert resolve_attention("auto", cpu, native_kernels=False) == "sdpa"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_attention("cpu", torch.device("cuda"))
    llm = LLM("tiny", dtype="float32")
    assert llm.engine.describe()["attention_backend"] == "cpu"

    monkeypatch.setattr(native, "_state", {"lib": None, "reason": "RuntimeError: no compiler"})
    assert resolve_attention("auto", torch.device("cpu")) == "sdpa"
    with pytest.raises(ValueError, match=r"attention_backend: 'cpu'.*no compiler"):
        make_attention("cpu")


def test_bf16_and_int8_caches_take_the_torch_path() -> None:
    """The kernel is fp32-only; other caches go through sdpa's path with the same tokens."""
    prompts = [list(range(10, 30)), [5, 6, 7]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for options in (dict(dtype="bfloat16"), dict(dtype="float32", kv_cache_dtype="int8")):
        got = [
            o.outputs[0].token_ids
            for o in LLM("tiny", attention_backend="cpu", **options).generate(prompts, params)
        ]
        want = [
            o.outputs[0].token_ids
            for o in LLM("tiny", attention_backend="sdpa", **options).generate(prompts, params)
        ]
        assert got == want, options


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_with_and_without_the_residual_add(rows: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 768, generator=gen), torch.randn(rows, 768, generator=gen)
    weight = torch.randn(768, generator=gen)
    expected = torch.nn.functional.rms_norm(x, (768,), weight, eps=1e-5)
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), expected)

    stream = residual.clone()
    out = native.rms_norm(x, weight, 1e-5, stream)
    total = x + residual
    assert torch.equal(stream, total)  # the residual stream now holds the sum, in place
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(total, (768,), weight, eps=1e-5))


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_silu_and_mul(rows: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 300, generator=gen) * 8  # saturates both tails of silu
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.split(300, dim=-1)
    expected = (torch.nn.functional.silu(gate.double()) * up.double()).float()
    torch.testing.assert_close(native.silu_and_mul(gate_up), expected, rtol=1e-6, atol=1e-30)


def test_pack_linear_weight_makes_transposed_zero_padded_panels() -> None:
    weight = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3)
    panels = native.pack_linear_weight(weight)
    panel = native.layout().panel
    assert panels.shape == (-(-70 // panel), 3, panel)  # panels of [K, panel]
    rows = panels.shape[0] * panel
    assert torch.equal(panels.transpose(1, 2).reshape(rows, 3)[:70], weight)
    assert not panels.transpose(1, 2).reshape(rows, 3)[70:].any()


# rows: one block of 8, partial blocks (1, 2, 3: the 1-, 2- and 4-row kernels), several blocks,
# and 300 = more than one pass over the weight (128 rows a pass)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 8, 13, 300])
@pytest.mark.parametrize(("in_features", "out_features"), [(768, 2304), (37, 5), (16, 70)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(
    rows: int, in_features: int, out_features: int, with_bias: bool, threads: int
) -> None:
    """Against float64 (the kernel sums in another order than torch's GEMM); 5 and 70 output
    features leave the last panel of 32 partial."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    expected = torch.nn.functional.linear(
        x.double(), weight.double(), None if bias is None else bias.double()
    )
    got = native.linear(x, native.pack_linear_weight(weight), out_features, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # the float32 error bound of a K-term dot product: ~K eps times the sum of |products|
    bound = in_features * 2**-23 * (x.double().abs() @ weight.double().abs().T)
    assert ((got.double() - expected).abs() <= bound + 1e-6).all()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(
        next(
            (
                line.split(":", 1)[1].split()
                for line in text.splitlines()
                if line.startswith("flags")
            ),
            [],
        )
    )


# Each instruction set the C file picks a GEMM block for (cpu_kernels.c), built for the one
# -march that selects it; tested where this CPU runs it (the native build covers its own).
ISA_BUILDS = [
    ("portable", "x86-64", set()),
    ("avx", "sandybridge", {"avx"}),
    ("avx2", "haswell", {"avx2", "fma"}),
    ("avx512", "skylake-avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
]


@pytest.mark.parametrize(
    ("isa", "march"),
    [
        (isa, march)
        for isa, march, needs in ISA_BUILDS
        if platform.machine() == "x86_64" and needs <= _cpu_flags()
    ],
)
def test_every_instruction_set_build_matches_torch(
    isa: str, march: str, tmp_path, monkeypatch
) -> None:
    """The GEMM and prompt attention of each register block, against float64 / torch: the
    packed layouts differ per build (panels of 8, 16 or 32), and Python follows the layout
    the library reports."""
    flags = [f"-march={march}" if f == "-march=native" else f for f in native.FLAGS]
    library = tmp_path / f"kernels-{isa}.so"
    subprocess.run(
        [native_cache.compiler(), *flags, "-o", str(library), *map(str, native.SOURCES), "-lm"],
        check=True,
        capture_output=True,
    )
    lib, layout = native.open_library(library)
    assert layout.isa == isa
    monkeypatch.setitem(native._state, "lib", lib)
    monkeypatch.setitem(native._state, "layout", layout)
    gen = torch.Generator().manual_seed(7)
    for rows, in_features, out_features in [
        (1, 37, 5),
        (2, 64, 70),
        (3, 16, 33),
        (5, 48, 80),
        (6, 48, 17),
        (7, 96, 64),
        (13, 37, 70),
        (300, 64, 40),
    ]:
        x = torch.randn(rows, in_features, generator=gen)
        weight = torch.randn(out_features, in_features, generator=gen)
        bias = torch.randn(out_features, generator=gen)
        got = native.linear(x, native.pack_linear_weight(weight), out_features, bias)
        expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    for heads, kv_heads, dim, window in [(4, 2, 16, None), (4, 4, 80, 5), (6, 1, 36, 40)]:
        lengths = [64, 130, 1, 7, 33]
        tokens = sum(lengths)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
        q = q.view(tokens, heads, dim)
        k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        out = native.prefill_attention(q, k, v, starts, dim**-0.5, window)
        expected = reference_prefill(q, k, v, lengths, dim**-0.5, window)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the INT8/INT4 kernels at every vector width this build has (x86-64: the generic
    # vector code without SSE4.1's widening; sandybridge: 8 floats without AVX2's)
    for path in native_quant.paths():
        for rows in (1, 3, 40):
            q4 = torch.randint(0, 16, (21, 128), generator=gen, dtype=torch.int32)
            scales, mins = torch.rand(21, 2, generator=gen), -torch.rand(21, 2, generator=gen)
            w4 = q4.double().reshape(21, 2, 64) * scales.double()[..., None]
            w4 = (w4 + mins.double()[..., None]).reshape(21, 128)
            q8 = torch.randint(-127, 128, (21, 45), generator=gen, dtype=torch.int8)
            x4, x8 = torch.randn(rows, 128, generator=gen), torch.randn(rows, 45, generator=gen)
            got4 = native_quant.int4_linear(
                x4, native_quant.pack_int4(q4), scales, mins, 64, path=path
            )
            torch.testing.assert_close(got4.double(), x4.double() @ w4.T, rtol=1e-5, atol=1e-4)
            got8 = native_quant.int8_linear(x8, q8, torch.ones(21), path=path)
            torch.testing.assert_close(
                got8.double(), x8.double() @ q8.double().T, rtol=1e-5, atol=1e-3
            )


def test_linear_edge_shapes_and_non_finite_rows() -> None:
    # no input features: the bias alone; no outputs: an empty result
    panels = native.pack_linear_weight(torch.zeros(5, 0))
    assert torch.equal(
        native.linear(torch.zeros(3, 0), panels, 5, torch.arange(5.0)),
        torch.arange(5.0).expand(3, 5),
    )
    assert native.linear(
        torch.ones(3, 4), native.pack_linear_weight(torch.zeros(0, 4)), 0
    ).shape == (3, 0)
    # a NaN or inf stays in its own row (rows share packed blocks of 8 and weight panels)
    x = torch.randn(11, 40)
    x[2, 7], x[9, 0] = float("nan"), float("inf")
    got = native.linear(x, native.pack_linear_weight(torch.randn(70, 40)), 70)
    finite = [r for r in range(11) if r not in (2, 9)]
    assert got[2].isnan().all() and not got[9].isfinite().any()
    assert got[finite].isfinite().all()
    # a view that starts inside its storage
    base = torch.randn(30, 40)
    weight = torch.randn(33, 40)
    torch.testing.assert_close(
        native.linear(base[5:20], native.pack_linear_weight(weight), 33),
        base[5:20] @ weight.T,
        rtol=1e-5,
        atol=1e-4,
    )


def test_linear_rejects_what_it_cannot_take() -> None:
    panels = native.pack_linear_weight(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="linear"):
        native.linear(torch.zeros(2, 7), panels, 4)  # widths differ
    with pytest.raises(ValueError, match="linear"):
        native.linear(torch.zeros(2, 8), panels, 40)  # 40 outputs need 2 panels
    with pytest.raises(ValueError, match="linear"):
        native.linear(torch.zeros(2, 8), panels, 4, torch.zeros(3))  # bias length
    with pytest.raises(ValueError, match="linear"):
        native.linear(torch.zeros(2, 8, dtype=torch.float64), panels, 4)
    with pytest.raises(ValueError, match="linear"):
        native.linear(torch.zeros(8, 2).T, panels, 4)  # not contiguous
    with pytest.raises(ValueError, match="linear"):
        native.linear(torch.zeros(2, 2, 8), panels, 4)
    with pytest.raises(ValueError, match="pack_linear_weight"):
        native.pack_linear_weight(torch.zeros(4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("with_cache", [True, False])
@pytest.mark.parametrize("tokens", [11, 60])  # 60: enough work for the parallel loop
def test_rope_and_cache_equals_torch_rotary_and_cache_write(
    heads: int, kv_heads: int, with_cache: bool, tokens: int, threads: int
) -> None:
    dim = 32
    gen = torch.Generator().manual_seed(heads)
    rope = RotaryEmbedding(dim, 128, 10000.0, None, torch.device("cpu"))
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    rotated = apply_rotary(qk.reshape(tokens, heads + kv_heads, dim), rope.rotation(positions))
    k_cache = torch.zeros(128, kv_heads, dim)
    v_cache = torch.zeros(128, kv_heads, dim)
    slots = torch.randperm(128, generator=gen)[:tokens]
    got = qkv.clone()
    native.rope_and_cache(
        got,
        positions,
        rope.cos_sin_table,
        heads,
        kv_heads,
        dim,
        k_cache if with_cache else None,
        v_cache if with_cache else None,
        slots if with_cache else None,
    )
    # the same products and sums as torch's separate ops: bit for bit
    assert torch.equal(got[:, : (heads + kv_heads) * dim].view_as(rotated), rotated)
    assert torch.equal(got[:, (heads + kv_heads) * dim :], v)  # V is not rotated
    if with_cache:
        assert torch.equal(k_cache[slots], rotated[:, heads:])
        assert torch.equal(v_cache[slots], v.view(tokens, kv_heads, dim))
        untouched = torch.ones(128, dtype=torch.bool)
        untouched[slots] = False
        assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="contiguous"),
        dict(
            kv_cache="paged", block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=16
        ),
        dict(kv_cache="none"),
        dict(kv_cache="paged", model_overrides={"sliding_window": 6, "num_kv_heads": 1}),
        dict(kv_cache="contiguous", batching="static"),  # padding rows: the torch store path
    ],
)
def test_engine_tokens_with_and_without_native_kernels(options: dict, monkeypatch) -> None:
    """The same greedy tokens (the norm, SiLU and attention sums round differently, rotary
    does not), and the kernels really ran when enabled and never when not."""
    calls: dict[str, int] = {}

    def counting(name: str):
        kernel = getattr(native, name)

        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return kernel(*args, **kwargs)

        return counted

    kernels = {
        "rms_norm",
        "silu_and_mul",
        "rope_and_cache",
        "decode_attention",
        "linear",
        "prefill_attention",
    }
    for name in kernels:
        monkeypatch.setattr(native, name, counting(name))
    prompts = [list(range(10, 40)), [5, 6, 7], list(range(50, 61))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = {}
    for enabled in (False, True):
        calls.clear()
        # layer by layer: the decode program calls the same kernels from C
        # (tests/engines/builtin/test_decode_program.py)
        llm = LLM(
            "tiny",
            dtype="float32",
            native_kernels=enabled,
            native_decode_program=False,
            **options,
        )
        assert llm.engine.describe()["native_kernels"] is enabled
        outputs[enabled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        expected = set(kernels)
        if options["kv_cache"] == "none":
            expected.discard("decode_attention")  # every step is a prefill
        assert set(calls) == (expected if enabled else set()), calls
    assert outputs[True] == outputs[False]


def test_native_kernels_only_for_float32_and_auto_follows_the_switch() -> None:
    assert LLM("tiny", dtype="bfloat16").engine.describe()["native_kernels"] is False
    assert (
        LLM(
            "tiny", dtype="float32", native_kernels=False, attention_backend="auto"
        ).engine.describe()["attention_backend"]
        == "sdpa"
    )
