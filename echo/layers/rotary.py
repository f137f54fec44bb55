"""Rotary position embedding (neox style: rotate halves), with Llama-3's frequency scaling."""

import math

import torch
from torch import nn

from echo.attention.backend import RopeInputs
from echo.layers.rope_scaling import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: RopeScaling | None = None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos of each frequency, then sin
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), -1),
                             persistent=False)

    def inputs(self, positions: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
               k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> RopeInputs:
        """What the attention backend needs to rotate a step's q/k (Qwen3's per-head q/k
        RMSNorm first when its weights are given)."""
        return RopeInputs(positions, self.cos_sin_cache, q_norm_weight, k_norm_weight, eps)
