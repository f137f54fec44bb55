"""RMSNorm, optionally fused with the residual add that precedes it, and with the all-reduce of
a row-parallel layer before that."""

import torch
from torch import nn

from echo.distributed.communication import all_reduce
from echo.distributed.parallel_state import TPGroup

# fp32 statistics, cast back before the weight multiply, as Hugging Face's Llama/Qwen3 do
from echo_kernels.reference import rms_norm_ref as rms_norm_reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, reduce_tp: TPGroup | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # with a residual, x is a row-parallel layer's partial sums over this group
        self.reduce_tp = reduce_tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual), x summed over
        reduce_tp's ranks first."""
        if residual is not None and self.reduce_tp is not None:
            fused = self.reduce_tp.norm_all_reduce
            if fused is not None and fused.fits(x):
                return fused(x, residual, self.weight, self.eps)
            x = all_reduce(x, self.reduce_tp)
        if x.is_cuda:
            from echo_kernels import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_reference(residual, self.weight, self.eps), residual
