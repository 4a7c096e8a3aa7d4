"""The Triton paged-KV kernels against the plain torch reference and the dense attention path.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton). Shapes are small and the kernels' tiles are shrunk
(partitions of 32 keys, 16-wide tiles) so that split-K, several query tiles and partial
tiles all occur on short sequences.
On a GPU machine run the same tests on the device: INFERLAB_TRITON_DEVICE=cuda pytest ...
(bf16 is then added to the dtypes; the interpreter mishandles bf16).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

DEVICE = os.environ.get("INFERLAB_TRITON_DEVICE", "cpu")  # see tests/conftest.py

from attention_batches import make_batch  # noqa: E402  (tests/ is on the path)

from engines.base import ConfigError  # noqa: E402
from engines.builtin import LLM  # noqa: E402
from engines.builtin.attention import (  # noqa: E402
    DenseAttention,
    make_attention,
    paged_reference,
    reference_kernel,
    triton_kernels,
)
from engines.builtin.attention.triton_backend import TritonAttention  # noqa: E402
from engines.builtin.kv_cache import LayerKVCache  # noqa: E402
from engines.sampling_params import SamplingParams  # noqa: E402

assert DEVICE != "cpu" or triton_kernels.interpreting(), "Triton interpreter not active"


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE != "cpu" else [])
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# Small tiles, so short test sequences still span several partitions and tiles.
SMALL = dict(partition_size=32, decode_block_n=16, prefill_block_m=16, prefill_block_n=16)

# (dtype index, block_size, num_heads, num_kv_heads, head_dim, sliding_window)
CONFIGS = [
    (0, 1, 4, 4, 16, None),  # MHA, token-granular blocks
    (1, 4, 4, 2, 16, 5),  # GQA 2, window
    (0, 16, 8, 2, 32, None),  # GQA 4
    (1, 32, 4, 1, 16, 8),  # MQA, window
    (0, 4, 2, 1, 64, 40),  # MQA, window wider than a partition boundary
    (1, 16, 4, 2, 128, None),
    (0, 8, 6, 3, 48, 20),  # head_dim not a power of two (padded to 64, masked)
]


def _ids(config) -> str:
    dt, bs, h, kvh, d, w = config
    return f"{str(DTYPES[dt])[6:]}-bs{bs}-h{h}kv{kvh}-d{d}-w{w}"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# ---- batch construction -------------------------------------------------------------------


# ---- cache write --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_write_kv_matches_reference_and_layer_write(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, kvh, d, t = 64 // block_size + 2, 2, 16, 9
    shape = (num_blocks, block_size, kvh, d)
    base_k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    base_v = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(t, kvh, d, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(t, kvh, d, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[[2, 5]] = -1  # padding tokens
    slots = slots.to(DEVICE)

    kc, vc = base_k.clone(), base_v.clone()
    triton_kernels.write_kv(k, v, kc, vc, slots)
    rk, rv = base_k.clone(), base_v.clone()
    paged_reference.write_kv(k, v, rk, rv, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)

    layer = LayerKVCache(num_blocks, block_size, kvh, d, dtype, torch.device(DEVICE))
    layer.k.copy_(base_k)
    layer.v.copy_(base_v)
    keep = slots >= 0
    layer.write(k[keep], v[keep], slots[keep])
    assert torch.equal(kc, layer.k) and torch.equal(vc, layer.v)

    via_backend = LayerKVCache(num_blocks, block_size, kvh, d, dtype, torch.device(DEVICE))
    via_backend.k.copy_(base_k)
    via_backend.v.copy_(base_v)
    TritonAttention.write_kv(k, v, via_backend, slots)
    assert torch.equal(via_backend.k, kc) and torch.equal(via_backend.v, vc)


# ---- decode -------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_decode_kernel_matches_reference(config) -> None:
    dt, bs, h, kvh, d, window = config
    dtype = DTYPES[dt]
    seqs = [(1, 1), (7, 1), (33, 1), (100, 1)]
    q, _, _, cache, meta = make_batch(
        seqs, 4, bs, h, kvh, d, dtype, window, seed=bs + h, device=DEVICE
    )
    scale = d**-0.5
    expected = paged_reference.decode_attention(
        q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, window
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
        )
        assert_close(out, expected, dtype)


# ---- prefill ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_prefill_kernel_matches_reference(config) -> None:
    dt, bs, h, kvh, d, window = config
    dtype = DTYPES[dt]
    # whole prompts (n == length), chunks with earlier context (n < length), a 1-token chunk
    seqs = [(1, 1), (7, 7), (33, 17), (40, 1), (37, 37)]
    q, _, _, cache, meta = make_batch(
        seqs, 0, bs, h, kvh, d, dtype, window, seed=bs * h, device=DEVICE
    )
    scale = d**-0.5
    expected = paged_reference.prefill_attention(
        q, cache.k, cache.v, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window
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
    )
    assert_close(out, expected, dtype)


# ---- the backend against the dense path -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_backend_matches_dense_attention_on_mixed_batch(config) -> None:
    dt, bs, h, kvh, d, window = config
    dtype = DTYPES[dt]
    decodes = [(1, 1), (45, 1), (100, 1)]
    prefills = [(33, 33), (50, 17), (5, 5), (70, 3)]
    q, k, v, cache, meta = make_batch(
        decodes + prefills,
        len(decodes),
        bs,
        h,
        kvh,
        d,
        dtype,
        window,
        seed=7 * bs + d,
        device=DEVICE,
    )
    scale = d**-0.5
    out = TritonAttention(**SMALL)(q, k, v, cache, meta, scale)
    dense = DenseAttention("torch", reference_kernel)(q, k, v, cache, meta, scale)
    assert_close(out, dense, dtype)
    nd = meta.num_decodes
    ref = paged_reference.prefill_attention(
        q,
        cache.k,
        cache.v,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        window,
        first_seq=nd,
    )
    ref[:nd] = paged_reference.decode_attention(
        q[:nd], cache.k, cache.v, meta.block_tables[:nd], meta.seq_lens[:nd], scale, window
    )
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("kind", ["decodes_only", "prefills_only"])
def test_backend_default_tiles(kind: str) -> None:
    """The production tile sizes (one 512-key partition, 64-wide tiles), sdpa as the dense
    kernel, a contiguous-layout block (block_size = max_model_len, not a power of two)."""
    seqs = [(3, 1), (200, 1)] if kind == "decodes_only" else [(150, 150), (90, 20)]
    nd = len(seqs) if kind == "decodes_only" else 0
    q, k, v, cache, meta = make_batch(
        seqs, nd, 200, 4, 2, 16, torch.float32, None, seed=3, device=DEVICE
    )
    out = make_attention("triton")(q, k, v, cache, meta, 0.25)
    dense = make_attention("sdpa")(q, k, v, cache, meta, 0.25)
    assert_close(out, dense, torch.float32)


def test_unsupported_inputs_are_refused_clearly() -> None:
    q, k, v, cache, meta = make_batch([(5, 1)], 1, 4, 2, 2, 16, torch.float32, None, device=DEVICE)
    with pytest.raises(RuntimeError, match="kv_cache=none"):
        TritonAttention()(q, k, v, None, meta, 1.0)
    with pytest.raises(ValueError, match="block_n: must be a power of two >= 16"):
        triton_kernels.decode_attention(
            q, cache.k, cache.v, meta.block_tables, meta.seq_lens, 1.0, block_n=24
        )
    with pytest.raises(ValueError, match="partition_size: 40 is not a multiple"):
        triton_kernels.decode_attention(
            q,
            cache.k,
            cache.v,
            meta.block_tables,
            meta.seq_lens,
            1.0,
            partition_size=40,
            block_n=16,
        )
    with pytest.raises(ValueError, match="KV heads"):  # 3 query heads over 2 KV heads
        triton_kernels.decode_attention(
            q[:, :1].repeat(1, 3, 1), cache.k, cache.v, meta.block_tables, meta.seq_lens, 1.0
        )
    with pytest.raises(ValueError, match="KV heads"):  # head_dim mismatch
        triton_kernels.prefill_attention(
            q[..., :8],
            cache.k,
            cache.v,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            1.0,
            max_query_len=1,
        )


# ---- end to end ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        dict(kv_cache="contiguous"),
        dict(
            kv_cache="contiguous",
            enable_chunked_prefill=True,
            max_num_batched_tokens=16,
            model_overrides={"sliding_window": 8},
        ),
        dict(kv_cache="paged", block_size=4, enable_prefix_caching=True),
    ],
    ids=["contiguous", "chunked-swa", "paged-prefix-cache"],
)
def test_engine_greedy_tokens_match_sdpa(options) -> None:
    """Greedy tokens of the whole engine with attention_backend=triton equal sdpa's. With
    prefix caching the prompts are run twice, so the second round prefills only the uncached
    tails, over cached keys (without it a second round would repeat the first: the
    interpreter's time, nothing more checked)."""
    prompts = [[11, 12, 13, 14, 15], list(range(100, 123)), list(range(500, 540))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    common = dict(
        model="tiny", dtype="float32", device=DEVICE, max_model_len=64, max_num_seqs=4, **options
    )

    rounds = 2 if options.get("enable_prefix_caching") else 1

    def run(llm: LLM) -> list[list[int]]:
        return [o.token_ids for _ in range(rounds) for o in llm.generate(prompts, params)]

    expected = run(LLM(**common, attention_backend="sdpa"))
    try:
        llm = LLM(**common, attention_backend="triton")
        assert all(
            isinstance(layer.attn.backend, TritonAttention)
            for layer in llm.engine.runner.model.layers
        )
    except ConfigError as e:  # the engine option is not switched on yet: swap the backend in
        assert "not implemented yet" in str(e)
        llm = LLM(**common, attention_backend="sdpa")
    for layer in llm.engine.runner.model.layers:
        layer.attn.backend = TritonAttention(**SMALL)  # small tiles: several partitions
    assert run(llm) == expected
