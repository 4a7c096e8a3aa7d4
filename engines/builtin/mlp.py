"""A decoder layer's gated MLP: down(act(gate(x)) * up(x)), gate and up in one projection; the
activation SiLU (SwiGLU) or GELU's tanh approximation (Gemma's GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin import native
from engines.builtin.distributed.group import TPGroup
from engines.builtin.layers.linear import Linear, LinearMethod
from engines.builtin.lora.batch import LoRABatch


class MLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        linear: LinearMethod,
        tp: TPGroup,
        activation: str = "silu",
    ) -> None:
        """`intermediate`: this rank's share; `tp`: the group whose partial sums it adds (a
        mixture-of-experts layer's experts pass a group of one and add once); `activation`:
        models.config.ACTIVATIONS."""
        super().__init__()
        self.gelu = activation == "gelu_pytorch_tanh"
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, linear)
        self.down_proj = Linear(self.intermediate, hidden, linear)  # row-parallel
        self.tp = tp
        self.native = False  # SiLU-and-multiply through the C kernel (use_native_kernels)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.native and not self.gelu and native.takes(gate_up):
            return self.tp.all_reduce(self.down_proj(native.silu_and_mul(gate_up), lora))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.tp.all_reduce(self.down_proj(gate * up, lora))
