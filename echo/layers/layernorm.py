"""RMSNorm, optionally fused with the residual add that precedes it."""

import torch
from torch import nn

# fp32 statistics, cast back before the weight multiply, as Hugging Face's Llama/Qwen3 do
from echo_kernels.reference import rms_norm_ref as rms_norm_reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from echo_kernels import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_reference(residual, self.weight, self.eps), residual
