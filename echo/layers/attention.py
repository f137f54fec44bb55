"""The attention layer: hands q/k/v and its own layer's KV cache to the step's backend."""

from dataclasses import dataclass

import torch
from torch import nn

from echo.attention.backend import AttentionBackend, AttentionMetadata, KVCache, RopeInputs


@dataclass(frozen=True)
class ForwardContext:
    """Everything attention needs for one step, passed down the model explicitly."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_caches: list[KVCache]  # one per layer


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
                rope: RopeInputs | None = None) -> torch.Tensor:
        """q [tokens, heads, d], k/v [tokens, kv_heads, d] -> [tokens, heads * d]; q/k are
        rotated by `rope` first (by the backend, fused with the KV-cache write)."""
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.meta, rope)
        return out.view(-1, self.num_heads * self.head_dim)
