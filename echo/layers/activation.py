"""SwiGLU activation: silu(gate) * up over a fused [..., 2d] input."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        # echo_kernels.l2_prefetch.L2Prefetch of the next layer's weight (ModelRunner sets it)
        self.l2_prefetch = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from echo_kernels import silu_and_mul

            rows = x.numel() // x.shape[-1]
            return silu_and_mul(x, self.l2_prefetch and self.l2_prefetch.for_rows(rows))
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
