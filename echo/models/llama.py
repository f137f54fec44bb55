"""Llama (SmolLM2, Llama-3.x): a stack of pre-norm attention + SwiGLU blocks.

Qwen3 (qwen3.py) is the same network with a per-head RMSNorm on q and k, so it subclasses the
attention block here.
"""

import torch
from torch import nn

from echo.attention.backend import RopeInputs
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.attention import Attention, ForwardContext
from echo.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from echo.layers.layernorm import RMSNorm
from echo.layers.linear import GateUpParallelLinear, QKVParallelLinear, RowParallelLinear
from echo.layers.quantization import AwqConfig
from echo.layers.rotary import RotaryEmbedding
from echo.models.arch import ModelArch


def norm_reduces(arch: ModelArch, tp: TPGroup) -> bool:
    """Whether the RMSNorm after o_proj and down_proj does their all-reduce (TPGroup.
    reduce_in_norm), so the two leave their partial sums unreduced. Not with biases: a
    row-parallel bias is added after the reduce."""
    return tp.size > 1 and tp.reduce_in_norm and not (arch.attention_bias or arch.mlp_bias)


def quantization_of(arch: ModelArch, name: str) -> AwqConfig | None:
    """The quantization of the linear layer called name in the checkpoint (a fused layer goes
    by its first part: q_proj, gate_proj), None where it is not quantized."""
    quant = arch.quantization
    return quant if quant is not None and quant.applies_to(name) else None


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads,
                                          arch.num_kv_heads, arch.attention_bias, tp,
                                          quantization_of(arch, f"{prefix}.q_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size,
                                        arch.attention_bias, tp,
                                        reduce_results=not norm_reduces(arch, tp),
                                        quant=quantization_of(arch, f"{prefix}.o_proj"))
        self.rope = rope
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx)

    def split_qkv(self, qkv: torch.Tensor):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (q.reshape(-1, self.num_heads, self.head_dim),
                k.reshape(-1, self.num_kv_heads, self.head_dim),
                v.reshape(-1, self.num_kv_heads, self.head_dim))

    def rope_inputs(self, positions: torch.Tensor) -> RopeInputs:
        return self.rope.inputs(positions)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), ctx)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               ctx: ForwardContext) -> torch.Tensor:
        """Attention and o_proj from qkv_proj's output."""
        q, k, v = self.split_qkv(qkv)
        # the backend rotates q/k, fused with the KV-cache write on GPU
        return self.o_proj(self.attn(q, k, v, ctx, self.rope_inputs(positions)))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPGroup, prefix: str = "mlp"):
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = GateUpParallelLinear(
            arch.hidden_size, size, arch.mlp_bias, tp,
            quantization_of(arch, f"{prefix}.gate_proj"))
        self.down_proj = RowParallelLinear(size, arch.hidden_size, arch.mlp_bias, tp,
                                           reduce_results=not norm_reduces(arch, tp),
                                           quant=quantization_of(arch, f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.swiglu(x))

    def normed(self, norm: RMSNorm, x: torch.Tensor,
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual): the norm inside gate_up where tuned."""
        act, residual = self.gate_up_proj.normed_swiglu(norm, x, residual)
        return self.down_proj(act), residual


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, arch: ModelArch, layer_idx: int, rope: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        self.self_attn = self.attention_cls(arch, layer_idx, rope, tp)
        self.mlp = self.make_mlp(arch, layer_idx, tp)
        # each reduces the partial sums of the row-parallel layer before it (the first layer's
        # input norm: the embedding's, over a zero residual)
        reduce_tp = tp if norm_reduces(arch, tp) else None
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, reduce_tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, reduce_tp)

    def make_mlp(self, arch: ModelArch, layer_idx: int, tp: TPGroup) -> nn.Module:
        """The block after attention (a mixture of experts overrides it)."""
        return LlamaMLP(arch, tp, f"model.layers.{layer_idx}.mlp")

    def forward(self, positions, hidden, residual, ctx: ForwardContext):
        # each norm runs inside the linear layer after it where start-up tuning found that
        # faster at one row (LinearBase.normed)
        qkv, residual = self.self_attn.qkv_proj.normed(self.input_layernorm, hidden, residual)
        hidden = self.self_attn.attend(positions, qkv, ctx)
        return self.mlp.normed(self.post_attention_layernorm, hidden, residual)


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, arch: ModelArch, tp: TPGroup, max_position: int):
        super().__init__()
        reduces = norm_reduces(arch, tp)
        self.embeds_unreduced = reduces
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp,
                                                   reduce_results=not self.embeds_unreduced)
        # one rotary table shared by every layer
        rope = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling)
        self.layers = nn.ModuleList(
            self.layer_cls(arch, i, rope, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, tp if reduces else None)
        # layers whose incoming residual stream a forward keeps in aux_hidden (an EAGLE-3
        # head drafts from them: echo/models/eagle3.py); none unless set
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: list[torch.Tensor] = []

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # partial sums: the first layer's input norm all-reduces them, fused with its norm
        residual = torch.zeros_like(hidden) if self.embeds_unreduced else None
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, ctx)
        if self.aux_layers:  # in aux_layers' order, a layer named twice kept twice
            self.aux_hidden = [aux[i] for i in self.aux_layers]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: ModelArch, tp: TPGroup = SINGLE, max_position: int | None = None):
        super().__init__()
        self.arch = arch
        self.model = self.model_cls(arch, tp, max_position or arch.max_position_embeddings)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
