"""KV memory on CPU: mapped up front (kv_cache_prefault) or lazily, zero-filled either way, and
the default paged pool no larger than the engine can fill at once."""

from __future__ import annotations

from collections.abc import Callable

import psutil
import pytest
import torch

from engines.base import ConfigError
from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache.storage import LayerKVCache, zeros
from engines.builtin.llm import LLM

MIB = 1 << 20


def rss_growth(make: Callable[[], object]) -> tuple[object, int]:
    process = psutil.Process()
    before = process.memory_info().rss
    made = make()
    return made, process.memory_info().rss - before


def test_prefault_maps_every_page_now_lazy_maps_none() -> None:
    shape = (64, 1024, 1024 // 4)  # 64 MiB of float32
    eager, eager_growth = rss_growth(
        lambda: zeros(shape, torch.float32, torch.device("cpu"), prefault=True)
    )
    lazy, lazy_growth = rss_growth(lambda: zeros(shape, torch.float32, torch.device("cpu")))
    assert eager_growth >= 56 * MIB
    assert lazy_growth <= 8 * MIB
    for tensor in (eager, lazy):
        assert isinstance(tensor, torch.Tensor) and tensor.shape == shape
        assert tensor.dtype == torch.float32 and not tensor.any()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_a_prefaulted_cache_is_zeroed_and_writable(kv_cache_dtype: str) -> None:
    cache = LayerKVCache(
        4, 8, 2, 16, torch.bfloat16, torch.device("cpu"), kv_cache_dtype, prefault=True
    )
    assert not cache.k.float().any() and not cache.v.float().any()
    k = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    v = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    cache.write(k, v, torch.tensor([0, 9, 31]))
    keys, values = cache.gather(torch.tensor([[0], [1], [3]]), 8, 8)
    atol = {"auto": 0.0, "int8": 0.05, "fp8": 0.1}[kv_cache_dtype]
    rtol = 0.07 if kv_cache_dtype == "fp8" else 0.02  # e4m3: 2^-4 relative rounding
    assert keys.shape == values.shape == (3, 8, 2, 16)
    torch.testing.assert_close(keys[0, 0].float(), k[0].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(keys[1, 1].float(), k[1].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(values[2, 7].float(), v[2].float(), atol=atol, rtol=rtol)


def test_prefault_is_checked_by_name() -> None:
    with pytest.raises(
        ConfigError,
        match=r"engine\.kv_cache_prefault: 'yes' is invalid; "
        r"allowed: true\|false",
    ):
        EngineConfig(kv_cache_prefault="yes")  # type: ignore[arg-type]


def test_default_paged_pool_on_cpu_holds_what_all_slots_can_fill() -> None:
    llm = LLM(
        model="tiny",
        dtype="float32",
        device="cpu",
        kv_cache="paged",
        block_size=16,
        max_model_len=100,
        max_num_seqs=3,
    )
    # 3 slots x ceil(100 / 16) = 21 blocks, plus the null block
    assert llm.engine.kv.layout.num_blocks == 3 * 7 + 1
    pinned = LLM(
        model="tiny",
        dtype="float32",
        device="cpu",
        kv_cache="paged",
        block_size=16,
        max_model_len=100,
        max_num_seqs=3,
        kv_cache_memory_bytes=40 * 16 * llm.engine.kv.layout.bytes_per_token,
    )
    assert pinned.engine.kv.layout.num_blocks == 40 + 1  # an explicit budget is taken as given
