"""Linear layers that own their tensor-parallel sharding.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies this
rank's slice of a full checkpoint tensor into place (reading only that slice when the tensor is
a lazy CheckpointTensor); fused layers (QKV, gate/up) take a shard id naming which checkpoint
tensor the slice came from.

AWQ (W4A16, `quant`): instead of `weight` [out, in] a layer holds AutoAWQ's `qweight` int32
[in, out/8] (eight 4-bit values per int32 along the output, in AWQ's interleaved order),
`qzeros` int32 [in/G, out/8] and `scales` [in/G, out]; W = (q - z) * s per group of G inputs.
Each parameter says where its output and input dimensions are and how they are packed
(`output_dim`, `output_pack`, `input_dim`, `input_block`), so the same loaders slice both
layouts: column-parallel layers along the packed output, row-parallel ones along whole groups.
On a GPU, `use_awq_tensor_cores` may then repack `qweight` for the tensor-core kernels
(echo_kernels/awq_mma.py; the same int32 count, [out/16, in/64, 32, 4]).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from echo.distributed.communication import all_reduce
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.activation import silu_and_mul
from echo.layers.checkpoint_tensor import whole
from echo.layers.layernorm import RMSNorm
from echo.layers.quantization import AWQ_PACK, AwqConfig


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size "
                         f"({denominator})")
    return numerator // denominator


class LinearBase(nn.Module):
    # whether an RMSNorm's output is this layer's whole input in a decoder layer (its caller
    # goes through `normed`), so start-up tuning also times the norm inside its kernel
    follows_norm = False

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup,
                 quant: AwqConfig | None = None):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.quant = quant
        self.awq_repacked = False  # qweight in awq_mma's layout (use_awq_tensor_cores)
        # with it, zeroed arrival counts: awq_mma_gemv's splits add their sums in its launch
        self.register_buffer("awq_arrivals", None, persistent=False)
        if quant is None:
            self.weight = self._param((output_size, input_size), torch.get_default_dtype(),
                                      output_dim=0, input_dim=1)
        else:
            self._awq_params(input_size, output_size, quant.group_size)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # row count -> a kernel that beat the default for this shape (worker/linear_tuning.py):
        # fn(x, weight) in place of cuBLAS, or fn(x, *awq_operands()) in place of awq_linear
        self.small_m_kernels: dict[int, Callable] = {}
        # row count -> fn(x, residual, norm weight, eps, weight) -> (self(RMSNorm(x +
        # residual)), x + residual) in one launch (normed)
        self.normed_kernels: dict[int, Callable] = {}

    def normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
               then: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(then(norm(x + residual)), x + residual), then being this layer (self) unless
        given; x alone where residual is None. The norm runs inside this layer's kernel where
        start-up tuning found that faster (that kernel computes `then` itself)."""
        kernel = self.normed_kernel(norm, x)
        if kernel is not None:
            return kernel(x, residual, norm.weight, norm.eps, self.weight)
        x, residual = _norm(norm, x, residual)
        return (then or self)(x), residual

    def normed_kernel(self, norm: RMSNorm, x: torch.Tensor) -> Callable | None:
        """The tuned kernel with `norm` inside for x's row count, if any (never when the norm
        also all-reduces)."""
        return None if norm.reduce_tp is not None else _tuned(self.normed_kernels, x)

    def _param(self, shape, dtype, output_dim: int, input_dim: int, output_pack: int = 1,
               input_block: int = 1) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.output_dim, param.output_pack = output_dim, output_pack
        param.input_dim, param.input_block = input_dim, input_block
        param.weight_loader = self.weight_loader
        return param

    def _awq_params(self, input_size: int, output_size: int, group_size: int) -> None:
        if output_size % AWQ_PACK:
            raise ValueError(f"AWQ: output size {output_size} (per rank) is not a multiple of "
                             f"{AWQ_PACK}: tensor_parallel_size splits a pack")
        if input_size % group_size:
            raise ValueError(f"AWQ: input size {input_size} (per rank) is not a multiple of "
                             f"group_size {group_size}: tensor_parallel_size splits a group")
        groups, packed = input_size // group_size, output_size // AWQ_PACK
        self.qweight = self._param((input_size, packed), torch.int32, 1, 0, AWQ_PACK)
        self.qzeros = self._param((groups, packed), torch.int32, 1, 0, AWQ_PACK, group_size)
        self.scales = self._param((groups, output_size), torch.get_default_dtype(), 1, 0, 1,
                                  group_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded)

    def use_awq_tensor_cores(self, sum_inside: bool) -> bool:
        """After loading: repack an AWQ layer's qweight on a CUDA device for the tensor-core
        kernels, where its shape allows (groups of 64 inputs or more, 128 outputs a block) and
        the GPU has mma_v2's bf16 m16n8k16 (compute capability 8.0, Ampere, or newer). Whether
        it did. sum_inside: the GEMV's splits add their sums in its launch (arrival counts)."""
        from echo_kernels.awq_mma import CHUNK, OUTPUT_BLOCK, arrival_counts, repack_awq

        group = self.quant.group_size if self.quant is not None else 0
        if (self.quant is None or self.awq_repacked or not self.qweight.is_cuda
                or torch.cuda.get_device_capability(self.qweight.device)[0] < 8
                or group % CHUNK or self.output_size % OUTPUT_BLOCK):
            return False
        self.qweight = nn.Parameter(repack_awq(self.qweight.data, group), requires_grad=False)
        if sum_inside:
            self.awq_arrivals = arrival_counts(self.output_size, self.qweight.device)
        self.awq_repacked = True
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight^T: cuBLAS, or the kernel start-up tuning picked for this many rows; AWQ
        layers through the W4A16 kernels (their PyTorch reference off the GPU)."""
        if self.quant is not None:
            return self._awq_matmul(x)
        kernel = _tuned(self.small_m_kernels, x)
        return F.linear(x, self.weight) if kernel is None else kernel(x, self.weight)

    def _awq_matmul(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """The AWQ product through the kernel start-up tuning gave x's rows, else awq_mma_linear
        for a repacked layer or awq_linear; swiglu: SwiGLU of its halves, inside the kernel (off
        the GPU after the reference)."""
        args = self.awq_operands()
        kernel = _tuned(self.small_m_kernels, x)
        if kernel is None and self.awq_repacked:
            from echo_kernels.awq_mma import awq_mma_linear

            return awq_mma_linear(x.contiguous(), *args, swiglu=swiglu)
        if kernel is None and not x.is_cuda:
            from echo_kernels.reference import awq_linear_ref

            y = awq_linear_ref(x, *args)
            return silu_and_mul(y) if swiglu else y
        if kernel is None:
            from echo_kernels import awq_linear as kernel
        return kernel(x.contiguous(), *args, swiglu=swiglu)

    def awq_operands(self) -> tuple:
        """An AWQ kernel's arguments after x: (qweight, qzeros, scales, group_size), and the
        arrival counts when repacked."""
        operands = (self.qweight, self.qzeros, self.scales, self.quant.group_size)
        return (*operands, self.awq_arrivals) if self.awq_repacked else operands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            if self.quant is not None:
                return self.matmul(x) + self.bias
            return F.linear(x, self.weight, self.bias)
        return self.matmul(x)


def _tuned(kernels: dict[int, Callable], x: torch.Tensor) -> Callable | None:
    """The kernel start-up tuning gave x's row count, if any."""
    return kernels.get(x.shape[0]) if kernels else None


def _norm(norm: RMSNorm, x: torch.Tensor,
          residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), or (norm(x), x) where residual is None."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def _output_part(param: nn.Parameter, tensor, start: int, size: int):
    """Output features [start, start + size) of tensor laid out as param is (packed or not)."""
    pack = getattr(param, "output_pack", 1)
    if start % pack or size % pack:
        raise ValueError(f"output features {start}..{start + size} split a pack of {pack}")
    return tensor.narrow(getattr(param, "output_dim", 0), start // pack, size // pack)


def _input_part(param: nn.Parameter, tensor, start: int, size: int):
    """Input features [start, start + size): rows of a dense weight's columns, or whole groups
    of AWQ's qzeros and scales."""
    block = getattr(param, "input_block", 1)
    if start % block or size % block:
        raise ValueError(f"input features {start}..{start + size} split a group of {block}")
    return tensor.narrow(getattr(param, "input_dim", 1), start // block, size // block)


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

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = SINGLE,
                 quant: AwqConfig | None = None):
        super().__init__(input_size, _divide(output_size, tp.size, "output size"), bias, tp,
                         quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = self.output_size
        _copy_checked(param.data, _output_part(param, loaded, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up of SwiGLU)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = SINGLE, quant: AwqConfig | None = None):
        # each part must split evenly on its own: a sum that divides while its parts do not
        # would make the loader place rows at the wrong offsets
        for size in output_sizes:
            _divide(size, tp.size, "output size")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        tp = self.tp
        offset = sum(self.output_sizes[:shard_id]) // tp.size
        size = self.output_sizes[shard_id] // tp.size
        shard = _output_part(param, loaded, tp.rank * size, size)
        _copy_checked(_output_part(param, param.data, offset, size), shard)


class GateUpParallelLinear(MergedColumnParallelLinear):
    """SwiGLU's gate and up projections, whose outputs only silu(gate) * up reads (swiglu)."""

    follows_norm = True

    def __init__(self, input_size: int, intermediate_size: int, bias: bool = False,
                 tp: TPGroup = SINGLE, quant: AwqConfig | None = None):
        super().__init__(input_size, [intermediate_size] * 2, bias, tp, quant)
        # row count -> fn(x, weight) giving silu(gate) * up in one launch, where start-up
        # tuning found it faster than the matmul and SwiGLU's own launch
        self.swiglu_kernels: dict[int, Callable] = {}

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T)."""
        if self.quant is not None and self.bias is None:  # inside the AWQ kernels
            return self._awq_matmul(x, swiglu=True)
        kernel = _tuned(self.swiglu_kernels, x)
        if kernel is not None:
            return kernel(x, self.weight)
        return silu_and_mul(self(x))

    def normed_swiglu(self, norm: RMSNorm, x: torch.Tensor,
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(swiglu(norm(x + residual)), x + residual), as normed (whose kernels here give
        SwiGLU's output)."""
        return self.normed(norm, x, residual, self.swiglu)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; KV heads are replicated when tp > num_kv_heads."""

    follows_norm = True

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = SINGLE, quant: AwqConfig | None = None):
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
        super().__init__(hidden_size, output_size, bias, tp, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp.rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp.rank // self.kv_replicas
        _copy_checked(_output_part(param, param.data, offset, size),
                      _output_part(param, loaded, index * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results are summed with an all-reduce, here
    or (reduce_results=False) by whoever consumes them."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = SINGLE,
                 reduce_results: bool = True, quant: AwqConfig | None = None):
        super().__init__(_divide(input_size, tp.size, "input size"), output_size, bias, tp,
                         quant)
        if bias and not reduce_results:
            raise ValueError("a row-parallel bias is added after the all-reduce: "
                             "reduce_results=False needs bias=False")
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: not sharded, added once after the reduce
            _copy_checked(param.data, loaded)
            return
        size = self.input_size
        _copy_checked(param.data, _input_part(param, loaded, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if not self.reduce_results:
            return y
        y = all_reduce(y, self.tp)
        return y if self.bias is None else y + self.bias
