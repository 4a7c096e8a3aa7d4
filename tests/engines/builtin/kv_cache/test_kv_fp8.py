"""FP8 KV cache (`kv_cache_dtype=fp8 | fp8_e4m3 | fp8_e5m2`): values stored as torch's float8
formats with scale 1 (vLLM's default), clamped at the format's largest value, widened back on
every read; one byte an element. The C kernels (rotary + store, decode attention, the
whole-step program) write the very bytes torch writes and give the dense path's tokens; every
attention path and the cache's forks read it."""

from __future__ import annotations

import pytest
import torch

from engines.builtin import LLM, SamplingParams, native
from engines.builtin.kv_cache.storage import LayerKVCache, to_fp8

FORMATS = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_the_cache_holds_torch_s_own_rounding_and_clamps_the_rest(kv_cache_dtype: str) -> None:
    fp8 = FORMATS[kv_cache_dtype]
    cache = LayerKVCache(2, 4, 2, 8, torch.float32, torch.device("cpu"), kv_cache_dtype)
    assert cache.fp8 == fp8 and cache.k.element_size() == 1
    assert cache.quantized and not cache.scaled
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 8, generator=gen) * 30
    k[0, 0, 0] = 1e6  # past the format: the largest value, not inf or NaN
    v = torch.randn(5, 2, 8, generator=gen) * 1e-3  # small: subnormals
    cache.write(k, v, torch.tensor([0, 1, 2, 3, 5]))
    got_k, got_v = cache.gather(torch.tensor([[0, 1]]), 6, 4)
    top = torch.finfo(fp8).max
    assert got_k[0, 0, 0, 0] == top
    assert torch.equal(got_k[0, [0, 1, 2, 3, 5]], k.clamp(-top, top).to(fp8).float())
    assert torch.equal(got_v[0, [0, 1, 2, 3, 5]], v.to(fp8).float())
    assert torch.equal(to_fp8(torch.tensor([-1e9]), fp8).float(), torch.tensor([-top]))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_fp8_cache_attention_is_close_to_full_precision(kv_cache: str, kv_cache_dtype: str) -> None:
    outs = {}
    for dtype in ("auto", kv_cache_dtype):
        llm = LLM("tiny", dtype="float32", kv_cache=kv_cache, kv_cache_dtype=dtype)
        logits: list[torch.Tensor] = []
        llm.engine.add_logits_observer(lambda plan, lg, out=logits: out.append(lg))
        llm.generate(
            [list(range(100, 160))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        )
        outs[dtype] = torch.cat(logits)
    # prefill rows attend to fresh K/V (identical); decode rows read the FP8 cache
    diff = (outs["auto"] - outs[kv_cache_dtype]).abs().max().item()
    bound = {"fp8_e4m3": 0.05, "fp8_e5m2": 0.1}[kv_cache_dtype]  # 3 vs 2 mantissa bits
    assert 0 < diff < bound * outs["auto"].std().item()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_every_attention_path_gives_the_dense_fp8_engine_s_tokens(kv_cache_dtype: str) -> None:
    """The C kernels (the default on CPU: the whole-step program, or layer by layer), prefix
    caching, chunked prefill and the contiguous cache against the dense path over the same
    FP8 cache, token for token; forks (n=2) share their prompt's FP8 blocks. (Against the
    float cache, FP8's 2^-4 relative rounding flips 2 of 6 near-ties of this tiny random
    model: its closeness is the logits test above.)"""
    prompts = [list(range(100, 150)), [5, 6, 7], list(range(200, 230))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2)

    def tokens(**options: object) -> list[list[int]]:
        llm = LLM("tiny", kv_cache_dtype=kv_cache_dtype, **options)
        outs = llm.generate(prompts, params)
        assert all(o.outputs[0].token_ids == o.outputs[1].token_ids for o in outs)
        return [o.outputs[0].token_ids for o in outs]

    dense = tokens(kv_cache="paged", attention_backend="torch")
    program = LLM("tiny", kv_cache="paged", kv_cache_dtype=kv_cache_dtype).engine.describe()
    assert program["attention_backend"] == "cpu" and program["native_decode_program"]
    assert tokens(kv_cache="paged") == dense
    assert tokens(kv_cache="paged", native_decode_program=False) == dense
    assert tokens(kv_cache="paged", enable_prefix_caching=True) == dense
    assert tokens(kv_cache="paged", enable_chunked_prefill=True, max_num_batched_tokens=16) == dense
    assert tokens(kv_cache="contiguous", attention_backend="torch") == dense


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_c_store_writes_torch_s_bytes(kv_cache_dtype: str) -> None:
    """Every finite FP8 value, every tie between neighbours (to even), values past the largest
    (clamped), subnormals and random floats over 18 decades, stored by the C rotary + store
    kernel (as V rows: K rows are rotated first), against torch's clamp-then-convert."""
    fp8 = FORMATS[kv_cache_dtype]
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[torch.isfinite(values)].unique().sort().values
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([
        values, (values[1:] + values[:-1]) / 2,
        torch.randn(20000, generator=gen) * torch.logspace(-12, 6, 20000),
        torch.tensor([1e6, -1e30, 1e-30, -0.0]),
    ])  # fmt: skip
    x = x[: x.numel() // 64 * 64].view(-1, 64)
    rows = x.shape[0]
    qkv = torch.cat([torch.zeros(rows, 128), x], dim=1)  # a q head, a k head, a v head of 64
    table = torch.cat([torch.ones(1, 32), torch.zeros(1, 32)], dim=1)
    k, v = (torch.zeros(rows, 1, 1, 64, dtype=torch.uint8) for _ in range(2))
    format_ = native.kv_format(fp8)
    native.rope_and_cache(qkv, torch.zeros(rows, dtype=torch.int64), table, 1, 1, 64, k, v,
                          torch.arange(rows), kv_format=format_)  # fmt: skip
    assert torch.equal(v.view(rows, 64), to_fp8(x, fp8).view(torch.uint8))


def test_the_c_decode_attention_reads_fp8_as_the_dense_path() -> None:
    gen = torch.Generator().manual_seed(1)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        k, v = (to_fp8(torch.randn(6, 4, 2, 16, generator=gen), fp8) for _ in range(2))
        q = torch.randn(3, 4, 16, generator=gen)
        tables = torch.tensor([[0, 1], [2, 3], [5, 4]], dtype=torch.int32)
        lens = torch.tensor([7, 3, 8], dtype=torch.int32)
        got = native.decode_attention(
            q, k.view(torch.uint8), v.view(torch.uint8), tables, lens, 0.25, None,
            kv_format=native.kv_format(fp8),
        )  # fmt: skip
        for b in range(3):  # the dense reference over the widened values
            n = int(lens[b])
            keys = k.float()[tables[b].long()].reshape(-1, 2, 16)[:n].repeat_interleave(2, 1)
            vals = v.float()[tables[b].long()].reshape(-1, 2, 16)[:n].repeat_interleave(2, 1)
            weights = torch.softmax(torch.einsum("hd,thd->ht", q[b], keys) * 0.25, dim=-1)
            torch.testing.assert_close(got[b], torch.einsum("ht,thd->hd", weights, vals))
        with pytest.raises(TypeError, match=r"the KV cache torch\.uint8"):
            native.decode_attention(q, k.float(), v.float(), tables, lens, 0.25, None, kv_format=1)


def test_fp8_kv_is_one_byte_an_element() -> None:
    shape = {"head_dim": 64, "num_heads": 1, "num_kv_heads": 1}
    bf16 = LLM("tiny", dtype="bfloat16", model_overrides=shape).engine.kv.layout
    fp8 = LLM("tiny", dtype="bfloat16", kv_cache_dtype="fp8", model_overrides=shape).engine.kv
    assert fp8.layout.bytes_per_token == bf16.bytes_per_token / 2 == 2 * 2 * 64
    cache = LayerKVCache(4, 16, 2, 64, torch.bfloat16, torch.device("cpu"), "fp8_e5m2")
    assert cache.nbytes == 2 * 4 * 16 * 2 * 64


def test_fp8_kv_names_what_reads_it() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*allowed: auto\|torch\|sdpa\|cpu"):
        LLM("tiny", kv_cache_dtype="fp8", attention_backend="triton")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp4'; allowed: auto\|int8\|fp8"):
        LayerKVCache(1, 4, 1, 8, torch.float32, torch.device("cpu"), "fp4")
