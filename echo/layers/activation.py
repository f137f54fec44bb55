"""SwiGLU activation: silu(gate) * up over a fused [..., 2d] input."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:]: the Triton kernel on a GPU."""
    if x.is_cuda:
        from echo_kernels import silu_and_mul as kernel

        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
