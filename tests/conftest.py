"""Shared fixtures for the built-in engine tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engines.builtin import LLM


@pytest.fixture
def make_tiny() -> Callable[..., LLM]:
    """A fresh `tiny`-preset engine (dummy weights, fp32, CPU) with small limits."""

    def make(**options: Any) -> LLM:
        defaults: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=256,
                                        max_num_seqs=8)
        return LLM(model="tiny", **{**defaults, **options})

    return make


@pytest.fixture(scope="module")
def tiny_llm() -> LLM:
    """One shared contiguous-KV `tiny` engine for tests that only run generate to completion."""
    return LLM(model="tiny", dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)


@pytest.fixture(scope="session", autouse=True)
def _single_torch_thread():
    """The test models are tiny: one intra-op thread is fastest, and it keeps OpenMP from
    spinning (orders of magnitude slower) when other work shares the CPU cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
