"""RMSNorm, computed in float32 as Hugging Face Llama does, then cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin import native


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.native = False  # the engine's C kernel for CPU float32 (use_native_kernels)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the decoder's residual
        add and the next norm in one call (one pass of the C kernel when `native`)."""
        if self.native and native.takes(x, self.weight, *(() if residual is None else (residual,))):
            out = native.rms_norm(x, self.weight, self.eps, residual)  # residual += x in place
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # nothing to cast: the weight is applied inside the one fused op
            return F.rms_norm(x, x.shape[-1:], self.weight, eps=self.eps)
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)  # one fused op
        return self.weight * normed.to(x.dtype)
