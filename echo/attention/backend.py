"""The attention-backend interface: one batch of mixed prefill/decode work, paged KV cache.

The model runner builds one AttentionMetadata per step; every attention layer hands its q/k/v
and its own layer's cache to the backend. Backends differ only in how they compute (a PyTorch
reference on any device, Triton kernels on CUDA); they share the metadata and the cache layout
`[num_blocks, block_size, num_kv_heads, head_dim]` per layer.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = do not store
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context including this step's tokens
    max_seqlen_q: int
    max_seqlen_k: int
    # every sequence's run is its whole context (a first prefill): K/V can be read contiguously
    no_cached_prefix: bool = False
    # [num_seqs] int32, the sequences by descending seq_lens: decode attention starts the longest
    # first when its programs take more than one wave (None: batch order)
    seq_order: torch.Tensor | None = None
    # host copies for backends that loop over sequences (the torch reference)
    query_lens_cpu: tuple[int, ...] = ()
    seq_lens_cpu: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class RopeInputs:
    """Rotary embedding (after Qwen3's per-head q/k RMSNorm when its weights are given) that the
    backend applies to q/k before storing K/V, so a backend can fuse rotation and cache write."""

    positions: torch.Tensor  # [num_tokens]
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32: cos, then sin (neox style)
    q_norm_weight: torch.Tensor | None = None  # [head_dim]
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


@dataclass(frozen=True)
class KVCache:
    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    # int8 caches: [num_blocks, block_size, num_kv_heads] float32, stored as cache_scales lays
    # them out
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


SCALE_DTYPE = torch.float32  # int8 caches' dequant scales


def cache_scales(num_blocks: int, block_size: int, num_kv_heads: int, device: torch.device,
                 fill: float = 0.0, leading: tuple[int, ...] = ()) -> torch.Tensor:
    """One int8 cache's per-token, per-KV-head scales, indexed [num_blocks, block_size,
    num_kv_heads] but stored [num_blocks, num_kv_heads, block_size]. A decode program reads one
    KV head: stored that way, a block's 16 scales of its head are one 64-byte piece rather than
    16 floats 32 bytes apart, which made int8 decode faster (docs/benchmarks.md, History
    4d4a42e). Kernels take the strides, so the layout is this function's alone. leading: dims
    in front (several caches' scales in one tensor)."""
    return torch.full((*leading, num_blocks, num_kv_heads, block_size), fill, dtype=SCALE_DTYPE,
                      device=device).transpose(-2, -1)


class AttentionBackend(ABC):
    name: str

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, rope: RopeInputs | None = None) -> torch.Tensor:
        """q [tokens, heads, d], k/v [tokens, kv_heads, d] -> [tokens, heads, d]. Rotates q/k
        by `rope` (in place or not) and stores k/v into the cache at meta.slot_mapping first."""


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> AttentionBackend:
    if name == "torch":
        from echo.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    if name == "triton":
        from echo.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(f"attention_backend: unknown backend {name!r}")
