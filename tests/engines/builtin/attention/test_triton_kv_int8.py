"""The Triton kernels with an INT8 KV cache (`kv_cache_dtype=int8`).

The write kernel must store exactly what `storage.quantize_int8` stores (the torch write path),
and the decode/prefill kernels must read what `storage.dequantize_int8` reads: then the
Triton backend and the dense path attend over the very same numbers, and only float rounding
separates them (the same tolerances as for a full-precision cache). Against full precision the
difference is the quantization error; `test_decode_error_vs_full_precision_is_bounded` checks
it against the bound the scheme implies. On CPU everything runs under the Triton interpreter
(tests/conftest.py); on a GPU:
INFERLAB_TRITON_DEVICE=cuda pytest tests/engines/builtin/attention/test_triton_kv_int8.py.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from attention_batches import shuffled_block_tables, step_metadata

from engines.builtin import LLM
from engines.builtin.attention import (
    DenseAttention,
    paged_reference,
    reference_kernel,
    triton_kernels,
)
from engines.builtin.attention.triton_backend import TritonAttention, TritonKVCache
from engines.builtin.kv_cache import LayerKVCache
from engines.builtin.kv_cache.storage import dequantize_int8, quantize_int8
from engines.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

DEVICE = os.environ.get("INFERLAB_TRITON_DEVICE", "cpu")  # see tests/conftest.py
assert DEVICE != "cpu" or triton_kernels.interpreting(), "Triton interpreter not active"

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE != "cpu" else [])
# Kernel vs reference over the same dequantized K/V: float rounding only (as for fp caches).
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
SMALL = dict(partition_size=32, decode_block_n=16, prefill_block_m=16, prefill_block_n=16)

# (dtype index, block_size, num_heads, num_kv_heads, head_dim, sliding_window)
CONFIGS = [
    (0, 1, 4, 4, 16, None),  # MHA, token-granular blocks
    (1, 4, 4, 2, 16, 5),  # GQA 2, window
    (0, 16, 8, 2, 32, None),  # GQA 4
    (0, 8, 6, 3, 48, 20),  # head_dim not a power of two (masked lanes must not skew scales)
]


def _ids(config) -> str:
    dt, bs, h, kvh, d, w = config
    return f"{str(DTYPES[dt])[6:]}-bs{bs}-h{h}kv{kvh}-d{d}-w{w}"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def make_int8_batch(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    seed: int = 0,
):
    """A packed step over an INT8 cache: seqs[i] = (context length after the step, new
    tokens), decodes first. Blocks are handed out in a shuffled order and every slot starts
    with random quantized values (so a read past a sequence's end would show); this step's
    K/V are written by the Triton write kernel. Returns the full-precision K/V of every slot
    too ([num_blocks, block_size, kv_heads, d]), for the quantization-error check."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        # per-token magnitudes over two decades, so scales differ from token to token
        mag = torch.logspace(-1, 1, shape[0])[torch.randperm(shape[0], generator=gen)]
        x = torch.randn(*shape, generator=gen) * mag.view(-1, *([1] * (len(shape) - 1)))
        return x.to(dtype).to(DEVICE)

    tables, num_blocks = shuffled_block_tables(seqs, block_size, gen)
    cache = LayerKVCache(
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        dtype,
        torch.device(DEVICE),
        kv_cache_dtype="int8",
    )
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    full_k, full_v = randn(*shape), randn(*shape)
    every_slot = torch.arange(num_blocks * block_size, device=DEVICE)
    cache.write(full_k, full_v, every_slot)  # the torch write path fills the stale slots

    slots, meta = step_metadata(seqs, num_decodes, tables, block_size, window, DEVICE)
    total = meta.query_start_loc_host[-1]
    q, k, v = (
        randn(total, num_heads, head_dim),
        randn(total, num_kv_heads, head_dim),
        randn(total, num_kv_heads, head_dim),
    )
    TritonAttention.write_kv(k, v, cache, slots)
    full_k[slots], full_v[slots] = k, v
    full = (full_k.view(cache.k.shape), full_v.view(cache.v.shape))
    return q, k, v, cache, meta, full


def dequantized(cache: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache as the dense path reads it: values x scales, in the compute dtype."""
    return (
        dequantize_int8(cache.k, cache.k_scale, cache.dtype),
        dequantize_int8(cache.v, cache.v_scale, cache.dtype),
    )


# ---- cache write --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("head_dim", [16, 48])
def test_write_kernel_stores_the_bits_the_torch_write_stores(
    dtype: torch.dtype, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, kvh, t = 6, 4, 2, 13
    mag = torch.logspace(-3, 2, t).view(t, 1, 1)
    k = (torch.randn(t, kvh, head_dim, generator=gen) * mag).to(dtype)
    v = (torch.randn(t, kvh, head_dim, generator=gen) * mag).to(dtype)
    k[3] = 0.0  # an all-zero head: scale clamps to 1e-8 / 127, values 0
    # exact .5 ties after division by the scale: torch.round rounds them half to even
    v[4, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5]).to(dtype)
    v[4, 0, 4:] = 0.0
    k, v = k.to(DEVICE), v.to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(DEVICE)

    torch_cache = LayerKVCache(
        num_blocks, block_size, kvh, head_dim, dtype, torch.device(DEVICE), kv_cache_dtype="int8"
    )
    torch_cache.write(k, v, slots)
    triton_cache = TritonKVCache(
        num_blocks, block_size, kvh, head_dim, dtype, torch.device(DEVICE), kv_cache_dtype="int8"
    )
    padded = torch.cat([k, k[:2]]), torch.cat([v, v[:2]])
    # two padding rows (slot -1) must be skipped, not written anywhere
    triton_cache.write(*padded, torch.cat([slots, torch.full((2,), -1, device=DEVICE)]))
    for plane in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(getattr(triton_cache, plane), getattr(torch_cache, plane)), plane
    q_ties, _ = quantize_int8(v[4:5, :1].cpu())
    assert q_ties[0, 0, :4].tolist() == [127, 0, 2, -2]  # the reference rounds half to even
    assert triton_cache.k_scale.dtype == torch.float16 and triton_cache.k.dtype == torch.int8


def test_int8_cache_needs_its_scales() -> None:
    cache = LayerKVCache(2, 4, 1, 16, torch.float32, torch.device(DEVICE), kv_cache_dtype="int8")
    k = torch.randn(1, 1, 16, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="int8 KV cache needs both scale planes"):
        triton_kernels.write_kv(k, k, cache.k, cache.v, slots)
    with pytest.raises(ValueError, match="k_scale: expected a floating"):
        triton_kernels.write_kv(
            k, k, cache.k, cache.v, slots, k_scale=cache.k_scale[:1], v_scale=cache.v_scale
        )
    q = torch.randn(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="int8 KV cache needs both scale planes"):
        triton_kernels.decode_attention(
            q,
            cache.k,
            cache.v,
            torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
            torch.ones(1, dtype=torch.int32, device=DEVICE),
            1.0,
        )


# ---- attention over an INT8 cache ------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_decode_kernel_reads_int8_like_the_reference(config) -> None:
    dt, bs, h, kvh, d, window = config
    dtype = DTYPES[dt]
    q, _, _, cache, meta, _ = make_int8_batch(
        [(1, 1), (7, 1), (33, 1), (100, 1)], 4, bs, h, kvh, d, dtype, window, seed=bs + h
    )
    scale = d**-0.5
    k_deq, v_deq = dequantized(cache)
    expected = paged_reference.decode_attention(
        q, k_deq, v_deq, meta.block_tables, meta.seq_lens, scale, window
    )
    for partition_size in (32, 512):  # split-K with a reduce, and the single-partition path
        out = triton_kernels.decode_attention(
            q,
            cache.k,
            cache.v,
            meta.block_tables,
            meta.seq_lens,
            scale,
            window,
            max_seq_len=meta.max_seq_len,
            partition_size=partition_size,
            block_n=16,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
        )
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_prefill_kernel_reads_int8_like_the_reference(config) -> None:
    dt, bs, h, kvh, d, window = config
    dtype = DTYPES[dt]
    seqs = [(1, 1), (7, 7), (33, 17), (40, 1), (37, 37)]
    q, _, _, cache, meta, _ = make_int8_batch(seqs, 0, bs, h, kvh, d, dtype, window, seed=bs * h)
    scale = d**-0.5
    k_deq, v_deq = dequantized(cache)
    expected = paged_reference.prefill_attention(
        q, k_deq, v_deq, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window
    )
    out = triton_kernels.prefill_attention(
        q,
        cache.k,
        cache.v,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        window,
        max_query_len=37,
        block_m=16,
        block_n=16,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_backend_matches_dense_path_on_int8_mixed_batch(config) -> None:
    """The whole backend (decodes + prefill chunks in one step) against DenseAttention, which
    gathers and dequantizes the same INT8 cache."""
    dt, bs, h, kvh, d, window = config
    dtype = DTYPES[dt]
    seqs = [(1, 1), (45, 1), (100, 1), (33, 33), (50, 17), (5, 5), (70, 3)]
    q, k, v, cache, meta, _ = make_int8_batch(
        seqs, 3, bs, h, kvh, d, dtype, window, seed=7 * bs + d
    )
    scale = d**-0.5
    out = TritonAttention(**SMALL)(q, k, v, cache, meta, scale)
    dense = DenseAttention("torch", reference_kernel)(q, k, v, cache, meta, scale)
    # dense prefills attend to this step's own fresh (unquantized) K/V when a prompt has no
    # earlier context; the kernels always read the cache. Compare rows that read the cache.
    qsl = meta.query_start_loc_host
    from_cache = [
        r
        for i in range(meta.num_seqs)
        if i < meta.num_decodes or meta.seq_lens_host[i] != qsl[i + 1] - qsl[i]
        for r in range(qsl[i], qsl[i + 1])
    ]
    assert len(from_cache) > 3
    assert_close(out[from_cache], dense[from_cache], dtype)
    k_deq, v_deq = dequantized(cache)
    nd = meta.num_decodes
    ref = paged_reference.prefill_attention(
        q,
        k_deq,
        v_deq,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        window,
        first_seq=nd,
    )
    ref[:nd] = paged_reference.decode_attention(
        q[:nd], k_deq, v_deq, meta.block_tables[:nd], meta.seq_lens[:nd], scale, window
    )
    assert_close(out, ref, dtype)


def test_decode_error_vs_full_precision_is_bounded() -> None:
    """Against the full-precision K/V, each output row errs by at most what quantization
    implies. With s_j the scores and d = max_j |s_j(int8) - s_j(full)| for the row, softmax
    weights change by a factor within e^(+-2d), so sum_j |p'_j - p_j| <= e^(2d) - 1, and
    |o' - o| <= max_j |v'_j - v_j| + (e^(2d) - 1) * max_j |v_j| (per output element)."""
    dtype, bs, h, kvh, d = torch.float32, 16, 4, 2, 32
    lens = [5, 40, 100]
    q, _, _, cache, meta, (full_k, full_v) = make_int8_batch(
        [(n, 1) for n in lens], 3, bs, h, kvh, d, dtype, None, seed=11
    )
    scale = d**-0.5
    out = triton_kernels.decode_attention(
        q,
        cache.k,
        cache.v,
        meta.block_tables,
        meta.seq_lens,
        scale,
        None,
        max_seq_len=max(lens),
        partition_size=32,
        block_n=16,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
    )
    exact = paged_reference.decode_attention(
        q, full_k, full_v, meta.block_tables, meta.seq_lens, scale
    )
    k_deq, v_deq = dequantized(cache)
    groups = h // kvh
    for b, length in enumerate(lens):
        slots = paged_reference.context_slots(meta.block_tables[b], length, bs)
        keys = full_k.view(-1, kvh, d)[slots].repeat_interleave(groups, 1)  # [L, h, d]
        keys_q = k_deq.view(-1, kvh, d)[slots].repeat_interleave(groups, 1)
        values = full_v.view(-1, kvh, d)[slots].repeat_interleave(groups, 1)
        values_q = v_deq.view(-1, kvh, d)[slots].repeat_interleave(groups, 1)
        score_err = (torch.einsum("hd,lhd->hl", q[b], keys_q - keys) * scale).abs().amax(1)
        bound = (values_q - values).abs().amax(dim=(0, 2)) + torch.expm1(
            2 * score_err
        ) * values.abs().amax(dim=(0, 2))  # [h]
        err = (out[b] - exact[b]).abs().amax(dim=-1)  # [h]
        assert (err <= bound + 1e-5).all(), (b, err, bound)
        assert (err > 0).any()  # the cache really is quantized


# ---- end to end ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="contiguous"),
        dict(kv_cache="paged", block_size=4, enable_prefix_caching=True),
        dict(
            kv_cache="paged", block_size=8, enable_chunked_prefill=True, max_num_batched_tokens=16
        ),
    ],
    ids=["contiguous", "paged-prefix-cache", "paged-chunked"],
)
def test_engine_greedy_tokens_triton_int8_equal_torch_int8(options) -> None:
    """attention_backend=triton and attention_backend=torch over an INT8 KV cache: the same
    greedy tokens. (Both store identical INT8 bits; only float rounding differs.) With prefix
    caching the prompts run twice, so the second round's prompts are served from cached INT8
    blocks (without it a second round would repeat the first)."""
    prompts = [[11, 12, 13, 14, 15], list(range(100, 123)), list(range(500, 540))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    common = dict(
        model="tiny",
        dtype="float32",
        device=DEVICE,
        max_model_len=64,
        max_num_seqs=4,
        kv_cache_dtype="int8",
        **options,
    )

    rounds = 2 if options.get("enable_prefix_caching") else 1

    def run(llm: LLM) -> list[list[int]]:
        return [o.token_ids for _ in range(rounds) for o in llm.generate(prompts, params)]

    expected = run(LLM(**common, attention_backend="torch"))
    llm = LLM(**common, attention_backend="triton")
    assert all(
        isinstance(layer.attn.backend, TritonAttention) and layer.attn.cache.quantized
        for layer in llm.engine.runner.model.layers
    )
    for layer in llm.engine.runner.model.layers:
        layer.attn.backend = TritonAttention(**SMALL)  # small tiles: several partitions
    assert run(llm) == expected


def test_ring_cache_is_still_refused_with_int8() -> None:
    """A sliding-window model's contiguous cache is a rotated ring, which the kernels cannot
    address through block tables: the step fails with the reason (INT8 or not)."""
    llm = LLM(
        model="tiny",
        dtype="float32",
        device=DEVICE,
        max_model_len=64,
        kv_cache_dtype="int8",
        attention_backend="triton",
        model_overrides={"sliding_window": 8},
    )
    [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out.error is not None and "rotated ring" in out.error
