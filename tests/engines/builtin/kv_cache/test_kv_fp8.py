"""FP8 KV cache (`kv_cache_dtype=fp8 | fp8_e4m3 | fp8_e5m2`): values stored as torch's float8
formats with scale 1 (vLLM's default), clamped at the format's largest value, widened back on
every read; one byte an element; every dense attention path and the cache's forks read it."""

from __future__ import annotations

import pytest
import torch

from engines.base import ConfigError
from engines.builtin import LLM, SamplingParams
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


def test_every_dense_attention_path_gives_the_plain_fp8_engine_s_tokens() -> None:
    """Prefix caching, chunked prefill and the contiguous cache against the plain paged FP8
    engine, token for token; forks (n=2) share their prompt's FP8 blocks. (Against the float
    cache, FP8's 2^-4 relative rounding flips 2 of 6 near-ties of this tiny random model:
    its closeness is the logits test above.)"""
    prompts = [list(range(100, 150)), [5, 6, 7], list(range(200, 230))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2)

    def tokens(**options: object) -> list[list[int]]:
        llm = LLM("tiny", kv_cache_dtype="fp8", **options)
        assert llm.engine.describe()["attention_backend"] != "cpu"  # the C kernel reads fp32
        outs = llm.generate(prompts, params)
        assert all(o.outputs[0].token_ids == o.outputs[1].token_ids for o in outs)
        return [o.outputs[0].token_ids for o in outs]

    plain = tokens(kv_cache="paged")
    assert tokens(kv_cache="paged", enable_prefix_caching=True) == plain
    assert tokens(kv_cache="paged", enable_chunked_prefill=True, max_num_batched_tokens=16) == plain
    assert tokens(kv_cache="contiguous", attention_backend="torch") == plain


def test_fp8_kv_is_one_byte_an_element() -> None:
    shape = {"head_dim": 64, "num_heads": 1, "num_kv_heads": 1}
    bf16 = LLM("tiny", dtype="bfloat16", model_overrides=shape).engine.kv.layout
    fp8 = LLM("tiny", dtype="bfloat16", kv_cache_dtype="fp8", model_overrides=shape).engine.kv
    assert fp8.layout.bytes_per_token == bf16.bytes_per_token / 2 == 2 * 2 * 64
    cache = LayerKVCache(4, 16, 2, 64, torch.bfloat16, torch.device("cpu"), "fp8_e5m2")
    assert cache.nbytes == 2 * 4 * 16 * 2 * 64


def test_fp8_kv_names_what_reads_it() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8'.*allowed: auto\|torch\|sdpa"):
        LLM("tiny", kv_cache_dtype="fp8", attention_backend="triton")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp4'; allowed: auto\|int8\|fp8"):
        LayerKVCache(1, 4, 1, 8, torch.float32, torch.device("cpu"), "fp4")
