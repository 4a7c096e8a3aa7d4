"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router scores every expert
for each token, the token goes through the `num_experts_per_tok` best, and their outputs are
summed, weighted by the softmax of the scores over all experts (renormalized over the chosen
ones where the checkpoint says so: `norm_topk_prob`, always for Mixtral). Qwen2-MoE adds a
shared expert every token goes through, scaled by a sigmoid gate of its own.

The step's tokens are grouped by expert once (a stable sort of the (token, choice) pairs by
expert), and each expert with tokens runs its MLP once on its rows: a GEMM per expert over the
rows routed to it, through whatever kernel its linear layers' method has (float, INT8, INT4).
The sum is taken expert by expert in ascending order, as Hugging Face's does, so the results
agree to float32 rounding. `last_routing` keeps the forward's tokens per expert for the
step's statistics (steps.parquet `moe_expert_tokens`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin.distributed.group import TPGroup
from engines.builtin.layers.linear import LinearMethod
from engines.builtin.lora.batch import LoRABatch
from engines.builtin.mlp import MLP
from models.config import ModelConfig


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearMethod, tp: TPGroup) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        # the router stays in the model's float dtype whatever the method: its scores pick
        # the experts, and a quantized one could pick others
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.router.weight.requires_grad_(False)
        alone = TPGroup()  # each expert's output is summed here, not reduced by itself
        inter = cfg.expert_intermediate_size
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, inter, linear, alone) for _ in range(cfg.num_experts)
        )
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg.hidden_size, shared, linear, alone) if shared else None
        self.shared_expert_gate = (
            nn.Linear(cfg.hidden_size, 1, bias=False).requires_grad_(False) if shared else None
        )
        self.tp = tp
        #: tokens routed to each expert in the last forward (the step's statistics)
        self.last_routing: list[int] = []

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `lora`: refused at start for MoE models."""
        scores = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        self.last_routing = counts
        out = torch.zeros_like(x)
        flat_weights = weights.flatten()
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            rows = pairs // self.top_k
            y = self.experts[expert](x.index_select(0, rows))
            out.index_add_(0, rows, y * flat_weights[pairs].unsqueeze(1))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return self.tp.all_reduce(out)
