"""Gemma 2's soft cap on attention scores: the dense backends attend through the reference
kernel with the cap (tests/engines/hf/test_hf_parity.py checks the logits against transformers);
a backend whose kernels take no cap is refused, naming the cap."""

from __future__ import annotations

import pytest
import torch

from engines.builtin import LLM
from engines.builtin.attention import make_attention
from engines.builtin.attention.dense import reference_kernel, softcapped


def test_the_reference_kernel_caps_scores_before_the_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen) * 20 for _ in range(3))
    capped = reference_kernel(q, k, v, None, 1.0, True, softcap=5.0)
    scores = torch.tanh((q @ k.transpose(-1, -2)) / 5.0) * 5.0
    scores = scores.masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(capped, scores.softmax(-1) @ v)
    assert not torch.allclose(capped, reference_kernel(q, k, v, None, 1.0, True))
    assert softcapped(5.0).caps_scores and softcapped(5.0) is softcapped(5.0)


def test_a_backend_without_soft_caps_is_refused_for_gemma2() -> None:
    pytest.importorskip("triton")
    assert not make_attention("triton").caps_scores
    with pytest.raises(ValueError, match="'triton' does not soft-cap attention scores"):
        LLM(model="tiny-gemma2", dtype="float32", attention_backend="triton", max_model_len=64)
