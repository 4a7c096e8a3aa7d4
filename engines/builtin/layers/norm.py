"""RMSNorm, computed in float32 as Hugging Face Llama does, then cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # nothing to cast: the weight is applied inside the one fused op
            return F.rms_norm(x, x.shape[-1:], self.weight, eps=self.eps)
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)  # one fused op
        return self.weight * normed.to(x.dtype)
