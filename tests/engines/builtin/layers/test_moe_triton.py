"""The Triton grouped expert GEMM (engines/builtin/layers/moe_triton.py) against the module
path's per-expert loop, and the MoE layer's CUDA path through it.

On CPU the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton); on a GPU machine: INFERLAB_TRITON_DEVICE=cuda pytest ..."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

DEVICE = os.environ.get("INFERLAB_TRITON_DEVICE", "cpu")  # see tests/conftest.py

from engines.builtin import LLM  # noqa: E402
from engines.builtin.layers import moe_triton  # noqa: E402
from engines.builtin.layers.quant_triton import interpreting  # noqa: E402
from engines.builtin.moe import MoE  # noqa: E402

assert DEVICE != "cpu" or interpreting(), "Triton interpreter not active"


def loop_reference(x, gate_up, down, rows, counts, pair_weights) -> torch.Tensor:
    """The module path's order: each expert's rows through its MLP, weighted, added."""
    inter = down.shape[2]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            span = slice(start, start + count)
            h = x[rows[span]] @ gate_up[expert].T
            y = (F.silu(h[:, :inter]) * h[:, inter:]) @ down[expert].T
            out.index_add_(0, rows[span], y * pair_weights[span].unsqueeze(1))
            start += count
    return out


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("counts_kind", ["spread", "one_expert", "some_idle"])
def test_grouped_experts_equal_the_loop(tokens: int, counts_kind: str) -> None:
    experts, top_k, hidden, inter = 6, 2, 48, 40  # sizes that are no multiple of the tiles
    gen = torch.Generator().manual_seed(tokens)
    if counts_kind == "one_expert":
        chosen = torch.stack([torch.full((tokens,), 3), torch.full((tokens,), 5)], 1)
    elif counts_kind == "some_idle":
        chosen = torch.randint(0, 3, (tokens, 1), generator=gen).repeat(1, 2)
        chosen[:, 1] = (chosen[:, 0] + 1) % 3  # experts 3..5 never chosen
    else:
        chosen = torch.stack(
            [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
        )
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    rows = order // top_k
    pair_weights = torch.rand(tokens * top_k, generator=gen)[order]
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    on = {"device": DEVICE}
    got = moe_triton.grouped_experts(
        x.to(**on), gate_up.to(**on), down.to(**on), rows.to(**on), counts, pair_weights.to(**on)
    )
    expected = loop_reference(x, gate_up, down, rows, counts, pair_weights)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)


def test_align_to_blocks_pads_each_expert_to_whole_blocks() -> None:
    rows = torch.tensor([4, 0, 2, 1, 3])  # expert 0: rows 4, 0; expert 2: rows 2, 1, 3
    slots, experts, position = moe_triton.align_to_blocks(rows, [2, 0, 3], block_m=2)
    assert experts.tolist() == [0, 2, 2]
    assert slots.tolist() == [4, 0, 2, 1, 3, -1]
    assert position.tolist() == [0, 1, 2, 3, 4]


def test_a_moe_layer_runs_its_experts_through_the_triton_kernel() -> None:
    """The layer's GPU path (forced here on the interpreter): the experts stacked once, the
    output that of the module path."""
    llm = LLM(
        model="tiny-moe", dtype="float32", max_model_len=64, native_kernels=False,
        prepack_weights=False,
    )  # fmt: skip
    moe = next(layer.mlp for layer in llm.engine.runner.model.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(
        9, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    expected = moe(x)
    moe.grouped_gemm = "triton"
    torch.testing.assert_close(moe(x), expected, rtol=1e-4, atol=1e-5)
    assert moe._stacked is not None and moe._stacked[0].shape[0] == 8
