"""The paged KV cache's memory: what one block costs and how the per-layer tensors are allocated.

Per layer, K and V are `[num_blocks, block_size, num_kv_heads, head_dim]`, in the model dtype
("auto", "bf16") or in int8 ("int8"). An int8 cache also keeps one float32 scale per token and
KV head, `k_scale/v_scale [num_blocks, block_size, num_kv_heads]` (symmetric absmax / 127, as
echo_kernels.cache.store_kv_cache writes them; stored head-major, see cache_scales), so a token
costs head_dim + 4 bytes per head instead of 2 * head_dim in bf16: 1.94x the blocks at head_dim
128.

Every layer's K and V are views of one tensor `[num_layers, 2, num_blocks, ...]` (and the
scales of another), so one block of every layer is one index along dim 2: the KV host tier
moves a chunk of blocks with a kernel or two, not several per layer (worker/kv_transfer.py).
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from echo.attention.backend import SCALE_DTYPE, KVCache, cache_scales


def kv_cache_spec(config) -> "KVCacheSpec":
    """One rank's cache shape from the engine config alone (no model built): its KV heads are
    the model's divided over the ranks, one (replicated) when there are more ranks than heads,
    as QKVParallelLinear splits them."""
    arch, tp = config.model.arch, config.parallel.tensor_parallel_size
    return KVCacheSpec(arch.num_layers, config.cache.block_size,
                       max(1, arch.num_kv_heads // tp), arch.head_dim,
                       getattr(torch, config.model.dtype), config.cache.kv_cache_dtype)


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one worker's cache (its own share of the KV heads under TP)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    model_dtype: torch.dtype
    kv_cache_dtype: str  # "auto", "bf16" or "int8" (CacheConfig.kv_cache_dtype)

    @property
    def is_int8(self) -> bool:
        return self.kv_cache_dtype == "int8"

    @property
    def dtype(self) -> torch.dtype:
        """What K and V are stored as."""
        return torch.int8 if self.is_int8 else self.model_dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, scales included."""
        per_head = self.head_dim * self.dtype.itemsize
        if self.is_int8:
            per_head += SCALE_DTYPE.itemsize
        return 2 * self.num_kv_heads * per_head * self.num_layers

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size

    def allocate(self, num_blocks: int, device: torch.device) -> list[KVCache]:
        """One zeroed KVCache per layer."""
        return self.allocate_stacked(num_blocks, device).layers

    def allocate_stacked(self, num_blocks: int, device: torch.device) -> "StackedKVCache":
        """One zeroed KVCache per layer, as views of two tensors (see StackedKVCache)."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        kv = zeros((self.num_layers, 2, *shape), self.dtype, device)
        scales = (cache_scales(*shape[:3], device, leading=(self.num_layers, 2))
                  if self.is_int8 else None)
        layers = [KVCache(kv[layer, 0], kv[layer, 1],
                          *((scales[layer, 0], scales[layer, 1]) if scales is not None else ()))
                  for layer in range(self.num_layers)]
        return StackedKVCache(kv, scales, layers)

    def describe(self, num_blocks: int, num_ranks: int = 1) -> str:
        """e.g. 'KV cache: int8, 12345 blocks of 16 tokens (197,520 tokens, 10.2 GiB)'; under
        TP every rank holds this many blocks of its own heads, so the size is per GPU."""
        gib = num_blocks * self.bytes_per_block() / 2**30
        where = f" on each of {num_ranks} GPUs" if num_ranks > 1 else ""
        return (f"KV cache: {self.dtype_name}, {num_blocks} blocks of {self.block_size} tokens "
                f"({num_blocks * self.block_size:,} tokens, {gib:.1f} GiB{where})")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU through calloc (numpy's zeros): a cache of a few GiB then
    costs nothing until its pages are used, where torch.zeros writes every page first (seconds
    per engine start on a small CPU machine, most of what starting one costs there)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


@dataclass(frozen=True)
class StackedKVCache:
    """A worker's cache: `kv [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
    head_dim]`, int8 caches' `scales` (cache_scales' layout with [num_layers, 2] in front), and
    `layers`, the per-layer KVCache views of them that the model reads and writes."""

    kv: torch.Tensor
    scales: torch.Tensor | None
    layers: list[KVCache]

    def planes(self) -> list[torch.Tensor]:
        """The cache as uint8 `[num_blocks, 2 * num_layers, bytes]` views, one per tensor (the
        scales in their stored order): indexing dim 0 takes a block of every layer."""
        tensors = [self.kv] + ([self.scales.transpose(-2, -1)] if self.scales is not None
                               else [])
        return [t.flatten(3).view(torch.uint8).flatten(0, 1).transpose(0, 1) for t in tensors]
