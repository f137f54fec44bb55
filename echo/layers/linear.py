"""Linear layers that own their tensor-parallel sharding.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies this
rank's slice of a full checkpoint tensor into place (reading only that slice when the tensor is
a lazy CheckpointTensor); fused layers (QKV, gate/up) take a shard id naming which checkpoint
tensor the slice came from.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from echo.distributed.communication import all_reduce
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.checkpoint_tensor import whole


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size "
                         f"({denominator})")
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # row count -> a kernel that beat cuBLAS for this shape (worker/linear_tuning.py)
        self.small_m_kernels: dict[int, Callable] = {}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight^T: cuBLAS, or the kernel start-up tuning picked for this many rows."""
        kernel = self.small_m_kernels.get(x.shape[0]) if self.small_m_kernels else None
        return F.linear(x, self.weight) if kernel is None else kernel(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.linear(x, self.weight, self.bias)
        return self.matmul(x)


def _copy_checked(dst: torch.Tensor, src) -> None:
    """src: a tensor or a CheckpointTensor (read here, after the shape check)."""
    if dst.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not match the layer's "
                         f"{tuple(dst.shape)}")
    dst.copy_(whole(src))


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the result."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = SINGLE):
        super().__init__(input_size, _divide(output_size, tp.size, "output size"), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up of SwiGLU)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = SINGLE):
        # each part must split evenly on its own: a sum that divides while its parts do not
        # would make the loader place rows at the wrong offsets
        for size in output_sizes:
            _divide(size, tp.size, "output size")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        tp = self.tp
        offset = sum(self.output_sizes[:shard_id]) // tp.size
        size = self.output_sizes[shard_id] // tp.size
        shard = loaded.narrow(0, tp.rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; KV heads are replicated when tp > num_kv_heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = SINGLE):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        if tp.size >= num_kv_heads:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size ({tp.size}) is not a multiple of "
                                 f"num_key_value_heads ({num_kv_heads})")
            self.num_kv_heads, self.kv_replicas = 1, tp.size // num_kv_heads
        else:
            kv_per_rank = _divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.num_kv_heads, self.kv_replicas = kv_per_rank, 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp.rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp.rank // self.kv_replicas
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, index * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results are summed with an all-reduce, here
    or (reduce_results=False) by whoever consumes them."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = SINGLE,
                 reduce_results: bool = True):
        super().__init__(_divide(input_size, tp.size, "input size"), output_size, bias, tp)
        if bias and not reduce_results:
            raise ValueError("a row-parallel bias is added after the all-reduce: "
                             "reduce_results=False needs bias=False")
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: not sharded, added once after the reduce
            _copy_checked(param.data, loaded)
            return
        size = param.shape[1]
        _copy_checked(param.data, loaded.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if not self.reduce_results:
            return y
        y = all_reduce(y, self.tp)
        return y if self.bias is None else y + self.bias
