"""The experts of one mixture-of-experts layer, stacked, with their tensor-parallel sharding.

w13 [E, 2I, H] holds each expert's gate (rows 0..I-1) and up (rows I..2I-1) projections, w2
[E, H, I] its down projection (transformers' packed Qwen3-MoE layout). Tensor parallelism
splits every expert's intermediate dimension I across ranks, so each rank holds all experts and
the down projection's partial sums are all-reduced once, as a dense MLP's are. The checkpoint
holds either one tensor per expert and projection (`experts.{e}.{gate,up,down}_proj.weight`) or
the packed pair (`experts.gate_up_proj`, `experts.down_proj`); both load into the same stack.
"""

import torch
from torch import nn

from echo.distributed.communication import all_reduce
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.checkpoint_tensor import whole

# checkpoint projection name -> (stacked parameter, half of w13: 0 gate, 1 up; None for w2)
EXPERT_PROJECTIONS = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", None)}


def moe_mlp(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The experts' output from the router's logits: softmax, top-k (renormalized when asked),
    the chosen experts' MLPs weighted and summed (echo_kernels.fused_moe)."""
    if hidden.is_cuda:
        from echo_kernels import fused_moe_from_logits

        return fused_moe_from_logits(hidden, w13, w2, router_logits, top_k, renormalize)
    from echo_kernels.reference import fused_moe_ref, moe_routing_ref

    return fused_moe_ref(hidden, w13, w2, *moe_routing_ref(router_logits, top_k, renormalize))


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: TPGroup = SINGLE, reduce_results: bool = True):
        super().__init__()
        if intermediate_size % tp.size:
            raise ValueError(f"moe_intermediate_size ({intermediate_size}) is not divisible by "
                             f"tensor_parallel_size ({tp.size})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp, self.reduce_results = tp, reduce_results
        self.intermediate = intermediate_size // tp.size  # this rank's share
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate),
                               requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = moe_mlp(hidden, self.w13, self.w2, router_logits, self.top_k, self.renormalize)
        return all_reduce(out, self.tp) if self.reduce_results and self.tp.size > 1 else out

    # ---- loading: shard_id (expert, "gate" | "up" | "down") for one expert's tensor, None for
    # the packed stack -----------------------------------------------------------------------

    def _load_w13(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if shard_id is None:  # [E, 2I, H]: this rank's rows of the gate half and the up half
            full = loaded.shape[1] // 2
            _check(loaded.shape, (self.num_experts, 2 * full, param.shape[2]), "gate_up_proj")
            for half in (0, 1):
                _copy(param.data[:, half * size:(half + 1) * size],
                      loaded.narrow(1, half * full + start, size))
            return
        expert, projection = shard_id
        half = EXPERT_PROJECTIONS[projection][1]
        _check(loaded.shape[1:], param.shape[2:], f"{projection}_proj")
        _copy(param.data[expert, half * size:(half + 1) * size], loaded.narrow(0, start, size))

    def _load_w2(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if shard_id is None:  # [E, H, I]: this rank's columns
            _check(loaded.shape[:2], param.shape[:2], "down_proj")
            _copy(param.data, loaded.narrow(2, start, size))
            return
        expert, _ = shard_id
        _check(loaded.shape[:1], param.shape[1:2], "down_proj")
        _copy(param.data[expert], loaded.narrow(1, start, size))


def _check(got, want, name: str) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: shape {tuple(got)} does not fit the layer's {tuple(want)}")


def _copy(dst: torch.Tensor, src) -> None:
    src = whole(src)
    if dst.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not match the layer's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)
