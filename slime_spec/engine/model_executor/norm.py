"""RMSNorm as the served families apply it (engine/model_executor/model.py, attention.py, mla.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slime_spec.engine.kernels.ops import Kernels, add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels = Kernels()  # CausalLM.use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """HF's Llama RMSNorm (float32 statistics, weight applied in the input dtype)."""
        if self.kernels.norm:
            return rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(h), h) with h = x + delta: a residual add and this norm, one kernel where `kernels.norm`."""
        if self.kernels.norm:
            return add_rms_norm(x, delta, self.weight, self.eps)
        h = x + delta
        return self(h), h
