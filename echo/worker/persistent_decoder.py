"""The model's batch-1 decode forward as one persistent launch (echo_kernels.persistent_decode):
Llama/Qwen3 with bf16 or AWQ linear layers, and Qwen3-MoE whose every layer is sparse.

startup.persistent_decoder builds it for a model it can run, or says why not; the decode CUDA
graph of batch size 1 then captures it in place of the model's forward (cuda_graphs.py), so
graph replays, several steps per launch and the sampling graphs over it are unchanged, and a
one-token step without a graph (enforce_eager, the CPU) calls it directly. The LM head stays
the model's (a cuBLAS GEMV that reaches the copy bandwidth on its own).
"""

import torch

from echo.attention.backend import KVCache
from echo.layers.attention import ForwardContext
from echo.models.arch import ModelArch
from echo.models.llama import LlamaForCausalLM, LlamaMLP
from echo.models.qwen3 import Qwen3ForCausalLM
from echo.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseBlock
from echo_kernels.persistent_decode import DecodeShape, PersistentDecode, pointer_table


def unsupported_reason(model: torch.nn.Module, kv_caches: list[KVCache],
                       tp_size: int) -> str | None:
    """Why the persistent kernel cannot run this model's decode step, or None if it can."""
    if type(model) not in (LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM):
        return f"{type(model).__name__} is not a Llama, Qwen3 or Qwen3-MoE model"
    if tp_size != 1:
        return "tensor parallelism"
    inner = model.model
    if inner.aux_layers:
        return "an EAGLE-3 head reads the model's hidden states"
    mlp_type = LlamaMLP if type(model) is not Qwen3MoeForCausalLM else Qwen3MoeSparseBlock
    quants = set()
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp) is not mlp_type:
            return "dense layers among sparse ones"
        linears = [attn.qkv_proj, attn.o_proj]
        linears += ([mlp.gate_up_proj, mlp.down_proj] if mlp_type is LlamaMLP else [mlp.gate])
        quants.update(linear.quant for linear in linears)
        if any(linear.bias is not None for linear in linears):
            return "linear biases"
    if len(quants) > 1:
        return "linear layers quantized unlike one another (modules_to_not_convert)"
    if None not in quants and mlp_type is not LlamaMLP:
        return "quantized weights in a mixture of experts"
    if any(cache.k_scale is not None for cache in kv_caches):
        return "an int8 KV cache"
    return None


def decode_shape(arch: ModelArch, block_size: int, num_layers: int | None = None,
                 awq_group_size: int = 0) -> DecodeShape:
    """The kernel's shape of a model (one GPU: the whole model's heads); awq_group_size: the
    linear layers' AWQ group size (0: not quantized)."""
    moe = arch.num_experts > 0
    return DecodeShape(
        hidden_size=arch.hidden_size,
        intermediate_size=arch.moe_intermediate_size if moe else arch.intermediate_size,
        num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        num_layers=num_layers or arch.num_layers, block_size=block_size, eps=arch.rms_norm_eps,
        qk_norm=arch.family in ("qwen3", "qwen3_moe"), num_experts=arch.num_experts,
        top_k=arch.num_experts_per_tok, norm_topk_prob=arch.norm_topk_prob,
        awq_group_size=awq_group_size)


class PersistentDecoder:
    """A callable like the model's forward for one decode token: (input_ids [1], positions
    [1], ctx) -> normed hidden state [1, hidden]."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int,
                 max_blocks: int):
        inner = model.model
        quant = inner.layers[0].self_attn.qkv_proj.quant
        self.shape = decode_shape(model.arch, block_size,
                                  awq_group_size=quant.group_size if quant else 0)
        layers = []
        for layer, cache in zip(inner.layers, kv_caches, strict=True):
            mlp = layer.mlp
            tensors = {
                "in_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "k_cache": cache.k,
                "v_cache": cache.v,
            }
            if self.shape.is_moe:
                tensors.update(router=mlp.gate.weight, gate_up=mlp.experts.w13,
                               down=mlp.experts.w2)
                linears = {}
            else:
                linears = {"gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
            linears.update(qkv=layer.self_attn.qkv_proj, o_proj=layer.self_attn.o_proj)
            for name, linear in linears.items():
                if linear.awq_repacked:
                    raise ValueError("persistent decode reads AutoAWQ's weight layout, not the "
                                     "tensor-core one: build the model with "
                                     "awq_tensor_cores=False")
                if quant:
                    tensors.update({name: linear.qweight, f"{name}_zeros": linear.qzeros,
                                    f"{name}_scales": linear.scales})
                else:
                    tensors[name] = linear.weight
            if self.shape.qk_norm:
                tensors["q_norm"] = layer.self_attn.q_norm.weight
                tensors["k_norm"] = layer.self_attn.k_norm.weight
            layers.append(tensors)
        k, attn = kv_caches[0].k, inner.layers[0].self_attn
        if any(c.k.stride() != k.stride() or c.v.stride() != k.stride() for c in kv_caches):
            raise ValueError("persistent decode: every layer's cache must share one layout")
        self.embed = inner.embed_tokens
        self.kernel = PersistentDecode(
            self.shape, pointer_table(layers, k.device), inner.norm.weight,
            attn.rope.cos_sin_cache, (k.stride(0), k.stride(1), k.stride(2)), max_blocks)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.meta
        # one tensor-parallel rank holds every row: the lookup is F.embedding's, written where
        # the kernel reads it
        torch.index_select(self.embed.weight, 0, input_ids[:1], out=self.kernel.input)
        hidden = self.kernel(meta.block_table[0], meta.seq_lens, positions, meta.slot_mapping)
        return hidden.view(1, -1)

    def raise_if_failed(self) -> None:
        """After a launch (the graph capture's warm-up runs one): a barrier that gave up
        waiting means the grid was not all resident at once, and that step's output is wrong."""
        if self.kernel.error():
            raise RuntimeError(
                f"persistent_decode: a grid barrier of {self.kernel.programs} programs gave up "
                "waiting (not all resident at once); start without persistent_decode")
