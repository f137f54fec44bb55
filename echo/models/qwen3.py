"""Qwen3 dense: Llama's network plus a per-head RMSNorm on q and k before RoPE."""

from echo.distributed.parallel_state import TPGroup
from echo.layers.layernorm import RMSNorm
from echo.layers.rotary import RotaryEmbedding
from echo.models.arch import ModelArch
from echo.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding, tp: TPGroup):
        super().__init__(arch, layer_idx, rope, tp)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def rope_inputs(self, positions):
        # the norm is fused into the rotary kernel on GPU
        return self.rope.inputs(positions, self.q_norm.weight, self.k_norm.weight,
                                self.q_norm.eps)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
