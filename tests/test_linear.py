"""The dense linear methods: the oneDNN-prepacked CPU path against F.linear, and end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.builtin import LLM, SamplingParams
from engines.builtin.layers.linear import Linear, PrepackedDenseMethod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 3, 48)])
def test_prepacked_equals_f_linear(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 48, generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    layer = Linear(48, 80, PrepackedDenseMethod(), bias=True)
    layer.load(weight, bias)
    x = torch.randn(*shape, generator=gen).to(dtype)
    got, want = layer(x), F.linear(x, weight, bias)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # a forward reads one copy of the weight: the packed copy is not counted twice
    assert layer.weight_bytes() == (weight.numel() + bias.numel()) * weight.element_size()


def test_engine_tokens_do_not_depend_on_prepacking() -> None:
    prompts = [list(range(10, 40)), list(range(50, 57)), [7, 8, 9, 10]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for prepack in (False, True):
        llm = LLM("tiny", dtype="float32", prepack_weights=prepack)
        assert llm.engine.describe()["prepacked_weights"] is prepack
        runs[prepack] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert runs[True] == runs[False]
