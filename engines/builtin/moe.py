"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router scores every expert
for each token, the token goes through the `num_experts_per_tok` best, and their outputs are
summed, weighted by the softmax of the scores over all experts (renormalized over the chosen
ones where the checkpoint says so: `norm_topk_prob`, always for Mixtral). Qwen2-MoE adds a
shared expert every token goes through, scaled by a sigmoid gate of its own.

The step's tokens are grouped by expert once (a stable sort of the (token, choice) pairs by
expert), and each expert with tokens runs its MLP once on its rows: a GEMM per expert over the
rows routed to it, through whatever kernel its linear layers' method has (float, INT8, INT4).
The sum is taken expert by expert in ascending order, as Hugging Face's does, so the results
agree to float32 rounding. With the engine's C kernels (CPU float32, `use_native_kernels`) the
experts run in one call, `native.moe_experts`: the same kernels in the same order, without the
~7 torch calls per expert between them. On a GPU, unquantized experts run as two grouped GEMMs
in Triton (layers/moe_triton.py) over the experts' weights stacked once (the experts' layers
then read views of the stacked tensors: one copy in memory). `last_routing` keeps the
forward's tokens per expert for the step's statistics (steps.parquet `moe_expert_tokens`).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin import native
from engines.builtin.distributed.group import TPGroup
from engines.builtin.distributed.shard import RankShard
from engines.builtin.layers.linear import DenseMethod, Linear, LinearMethod
from engines.builtin.layers.native_linear import linear_problem, linear_weights
from engines.builtin.lora.batch import LoRABatch
from engines.builtin.mlp import MLP
from models.config import ModelConfig


class MoE(nn.Module):
    def __init__(
        self, cfg: ModelConfig, linear: LinearMethod, tp: TPGroup, shard: RankShard | None = None
    ) -> None:
        """`shard`: under expert parallelism, which experts (and which share of the shared
        expert) this rank holds; the all-reduce at the end adds the ranks' outputs."""
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        # the router stays in the model's float dtype whatever the method: its scores pick
        # the experts, and a quantized one could pick others
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.router.weight.requires_grad_(False)
        alone = TPGroup()  # each expert's output is summed here, not reduced by itself
        inter = cfg.expert_intermediate_size
        self.local = range(cfg.num_experts) if shard is None else shard.experts
        # this rank's experts: self.experts[i] is expert self.local[i]
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, inter, linear, alone) for _ in self.local)
        shared = (
            cfg.shared_expert_intermediate_size
            if shard is None
            else shard.layout.shared_expert_intermediate
        )
        self.shared_expert = MLP(cfg.hidden_size, shared, linear, alone) if shared else None
        self.shared_expert_gate = (
            nn.Linear(cfg.hidden_size, 1, bias=False).requires_grad_(False) if shared else None
        )
        self.tp = tp
        #: tokens routed to each expert in the last forward, and its experts' MLPs' host time
        #: (the step's statistics)
        self.last_routing: list[int] = []
        self.last_expert_ns = 0
        self.native = False  # the experts in one C call (Transformer.use_native_kernels)
        #: auto: the Triton grouped GEMM on CUDA for unquantized experts; triton: wherever the
        #: kernel runs (the interpreter on CPU, for tests); loop: expert by expert
        self.grouped_gemm = "auto"
        self._stacked: tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None = None
        # the experts' C structs and the tensors they point into, built for the weights they
        # were built from (`_native_experts` builds them again if a layer was loaded anew)
        self._native: tuple[tuple[int, ...], Any, Any, list[torch.Tensor]] | None = None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `lora`: refused at start for MoE models."""
        scores = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        by_expert = torch.bincount(flat, minlength=self.router.out_features)
        counts = by_expert.tolist()
        self.last_routing = counts
        began = time.perf_counter_ns()
        out = torch.zeros_like(x)
        pair_weights = weights.flatten()[order]  # grouped by expert, as `order`
        rows = order // self.top_k  # each pair's token
        grouped = self._native_experts(x) if self.native else None
        ends = [0, *itertools.accumulate(counts)]  # expert e's pairs: ends[e] .. ends[e + 1]
        first, last = self.local.start, self.local.stop
        stacked = None if grouped is not None else self._stacked_experts(x)
        if grouped is not None:
            offsets = torch.tensor(ends[first : last + 1], dtype=torch.int64)
            native.moe_experts(*grouped, x, offsets, rows, pair_weights, out)
        elif stacked is not None:
            from engines.builtin.layers.moe_triton import grouped_experts

            span = slice(ends[first], ends[last])
            local = [counts[e] for e in self.local]
            out = grouped_experts(x, *stacked, rows[span], local, pair_weights[span])
        else:
            for mlp, expert in zip(self.experts, self.local, strict=True):
                if counts[expert]:
                    span = slice(ends[expert], ends[expert + 1])
                    y = mlp(x.index_select(0, rows[span]))
                    out.index_add_(0, rows[span], y * pair_weights[span].unsqueeze(1))
        self.last_expert_ns = time.perf_counter_ns() - began
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def _stacked_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts' gate_up [E, 2I, H] and down [E, H, I] weights stacked, where the
        Triton grouped GEMM runs them (None: the loop does)."""
        use = self.grouped_gemm == "triton" or (self.grouped_gemm == "auto" and x.is_cuda)
        mlps = [mlp for mlp in self.experts if isinstance(mlp, MLP)]
        layers = [layer for mlp in mlps for layer in (mlp.gate_up_proj, mlp.down_proj)]
        if not use or any(
            type(layer.method) is not DenseMethod or layer.weight is None or layer.bias is not None
            for layer in layers
        ):
            return None
        key = tuple(layer.weight.data_ptr() for layer in layers if layer.weight is not None)
        if self._stacked is None or self._stacked[2] != key:
            gate_up = torch.stack([mlp.gate_up_proj.weight for mlp in mlps])  # type: ignore[misc]
            down = torch.stack([mlp.down_proj.weight for mlp in mlps])  # type: ignore[misc]
            for mlp, up_rows, down_rows in zip(mlps, gate_up, down, strict=True):
                mlp.gate_up_proj.weight = nn.Parameter(up_rows, requires_grad=False)
                mlp.down_proj.weight = nn.Parameter(down_rows, requires_grad=False)
            key = tuple(layer.weight.data_ptr() for layer in layers if layer.weight is not None)
            self._stacked = (gate_up, down, key)
        return self._stacked[0], self._stacked[1]

    def _native_experts(self, x: torch.Tensor) -> tuple[Any, Any] | None:
        """The experts' gate_up and down layers as C arrays, or None where the C kernels do
        not take x or one of the layers."""
        if not native.takes(x) or x.dim() != 2:
            return None
        layers: list[Linear] = [
            layer
            for mlp in self.experts
            if isinstance(mlp, MLP)
            for layer in (mlp.gate_up_proj, mlp.down_proj)
        ]
        key = tuple(id(layer.method) for layer in layers) + tuple(
            (layer.panels if hasattr(layer, "panels") else layer.qweight).data_ptr()
            if linear_problem(layer) is None
            else -1
            for layer in layers
        )
        if self._native is None or self._native[0] != key:
            if -1 in key:
                self._native = (key, None, None, [])
            else:
                keep: list[torch.Tensor] = []
                structs = [linear_weights(layer, keep) for layer in layers]
                array = native.LinearWeights * len(self.experts)
                self._native = (key, array(*structs[0::2]), array(*structs[1::2]), keep)
        _, gate_up, down, _ = self._native
        return None if gate_up is None else (gate_up, down)
