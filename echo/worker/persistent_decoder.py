"""The model's batch-1 decode forward as one persistent launch (echo_kernels.persistent_decode).

`persistent_decoder` builds it for a model it can run, or says why not; the decode CUDA graph
of batch size 1 then captures it in place of the model's forward (cuda_graphs.py), so graph
replays, several steps per launch and the sampling graphs over it are unchanged. The LM head
stays the model's (a cuBLAS GEMV that reaches the copy bandwidth on its own).
"""

import torch

from echo.attention.backend import KVCache
from echo.layers.attention import ForwardContext
from echo.models.llama import LlamaForCausalLM, LlamaMLP
from echo.models.qwen3 import Qwen3ForCausalLM
from echo_kernels.persistent_decode import DecodeShape, PersistentDecode, pointer_table


def unsupported_reason(model: torch.nn.Module, kv_caches: list[KVCache],
                       tp_size: int) -> str | None:
    """Why the persistent kernel cannot run this model's decode step, or None if it can."""
    if type(model) not in (LlamaForCausalLM, Qwen3ForCausalLM):
        return f"{type(model).__name__} is not a dense Llama/Qwen3 model"
    if tp_size != 1:
        return "tensor parallelism"
    inner = model.model
    if inner.aux_layers:
        return "an EAGLE-3 head reads the model's hidden states"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp) is not LlamaMLP:
            return "a layer without the dense MLP"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(linear.quant is not None for linear in linears):
            return "quantized weights"
        if any(linear.bias is not None for linear in linears):
            return "linear biases"
    if any(cache.k_scale is not None for cache in kv_caches):
        return "an int8 KV cache"
    return None


class PersistentDecoder:
    """A callable like the model's forward for one decode token: (input_ids [1], positions
    [1], ctx) -> normed hidden state [1, hidden]."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int,
                 max_blocks: int):
        arch, inner = model.arch, model.model
        attn = inner.layers[0].self_attn
        qk_norm = isinstance(model, Qwen3ForCausalLM)
        self.shape = DecodeShape(
            hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            num_layers=arch.num_layers, block_size=block_size, eps=arch.rms_norm_eps,
            qk_norm=qk_norm)
        layers = []
        for layer, cache in zip(inner.layers, kv_caches, strict=True):
            tensors = {
                "in_norm": layer.input_layernorm.weight,
                "qkv": layer.self_attn.qkv_proj.weight,
                "o_proj": layer.self_attn.o_proj.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "gate_up": layer.mlp.gate_up_proj.weight,
                "down": layer.mlp.down_proj.weight,
                "k_cache": cache.k,
                "v_cache": cache.v,
            }
            if qk_norm:
                tensors["q_norm"] = layer.self_attn.q_norm.weight
                tensors["k_norm"] = layer.self_attn.k_norm.weight
            layers.append(tensors)
        k = kv_caches[0].k
        if any(c.k.stride() != k.stride() or c.v.stride() != k.stride() for c in kv_caches):
            raise ValueError("persistent decode: every layer's cache must share one layout")
        self.embed = inner.embed_tokens
        self.kernel = PersistentDecode(
            self.shape, pointer_table(layers, k.device), inner.norm.weight,
            attn.rope.cos_sin_cache, (k.stride(0), k.stride(1), k.stride(2)), max_blocks)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.meta
        hidden = self.kernel(self.embed(input_ids[:1])[0], meta.block_table[0], meta.seq_lens,
                             positions, meta.slot_mapping)
        return hidden.view(1, -1)
