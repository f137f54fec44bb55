"""The tensor-parallel group a layer belongs to, passed in explicitly (no global state)."""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    # a torch.distributed ProcessGroup when size > 1
    group: Any = None
    # small-message all-reduce over symmetric memory (SymmMemAllReduce), when enabled on CUDA
    small_all_reduce: Any = None
    # the RMSNorm after each row-parallel layer does that layer's all-reduce (models/llama.py)
    reduce_in_norm: bool = False
    # NormAllReduce: that all-reduce fused with the residual add and the norm, on CUDA
    norm_all_reduce: Any = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside [0, {self.size})")


SINGLE = TPGroup()
