"""Qwen3-MoE: Qwen3's attention, and in its sparse layers a router over experts in place of
the MLP (softmax, top-k, renormalized when norm_topk_prob); the layers in mlp_only_layers, or
off the decoder_sparse_step, keep a dense MLP."""

import re

import torch
from torch import nn

from echo.distributed.parallel_state import TPGroup
from echo.layers.fused_moe import EXPERT_PROJECTIONS, FusedMoE
from echo.layers.layernorm import RMSNorm
from echo.layers.linear import ReplicatedLinear
from echo.models.arch import ModelArch
from echo.models.llama import norm_reduces
from echo.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model

# experts.{e}.{gate,up,down}_proj.weight (one tensor each) or experts.{gate_up,down}_proj
_ONE_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_PACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up|down)_proj$")


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPGroup):
        super().__init__()
        # the router is small and every rank routes every token: replicated, not split
        self.gate = ReplicatedLinear(arch.hidden_size, arch.num_experts, False, tp)
        self.gate.follows_norm = True  # normed: the norm may run inside the router
        self.experts = FusedMoE(arch.num_experts, arch.num_experts_per_tok, arch.hidden_size,
                                arch.moe_intermediate_size, arch.norm_topk_prob, tp,
                                reduce_results=not norm_reduces(arch, tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))

    def normed(self, norm: RMSNorm, x: torch.Tensor,
               residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), as LlamaMLP.normed: where tuned, the norm
        runs inside the router's kernel, which also stores the normed rows for the experts."""
        kernel = self.gate.normed_kernel(norm, x)
        if kernel is None:
            x, residual = norm(x, residual)
            return self(x), residual
        normed = torch.empty_like(x)
        logits, residual = kernel(x, residual, norm.weight, norm.eps, self.gate.weight,
                                  normed_out=normed)
        return self.experts(normed, logits), residual


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, arch: ModelArch, layer_idx: int, tp: TPGroup) -> nn.Module:
        if arch.is_sparse_layer(layer_idx):
            return Qwen3MoeSparseBlock(arch, tp)
        return super().make_mlp(arch, layer_idx, tp)


class Qwen3MoeModel(Qwen3Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel

    @staticmethod
    def map_checkpoint_name(name: str) -> tuple[str, object] | None:
        """An expert tensor's parameter and shard id; None for the other tensors."""
        match = _ONE_EXPERT.match(name)
        if match:
            stack = EXPERT_PROJECTIONS[match[3]][0]
            return f"{match[1]}.{stack}", (int(match[2]), match[3])
        match = _PACKED.match(name)
        if match:
            return f"{match[1]}.{'w13' if match[2] == 'gate_up' else 'w2'}", None
        return None
