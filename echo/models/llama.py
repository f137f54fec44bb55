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
from echo.layers.linear import (
    GateUpParallelLinear,
    InResidual,
    QKVParallelLinear,
    RowParallelLinear,
    apply_norm,
)
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

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext,
               residual: torch.Tensor | None = None) -> torch.Tensor | InResidual:
        """Attention and o_proj from qkv_proj's output; given the residual stream, o_proj may
        add its output into it itself (RowParallelLinear.added_to)."""
        q, k, v = self.split_qkv(qkv)
        # the backend rotates q/k, fused with the KV-cache write on GPU
        return self.o_proj.added_to(self.attn(q, k, v, ctx, self.rope_inputs(positions)),
                                    residual)


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

    def takes_norm(self, rows: int) -> bool:
        """Whether gate_up reads the norm before it handed over, at this many rows."""
        return self.gate_up_proj.takes_norm(rows)

    def normed(self, norm: RMSNorm, x: torch.Tensor | InResidual, residual: torch.Tensor | None,
               hand_over: bool = False) -> tuple[torch.Tensor | InResidual, torch.Tensor]:
        """(self(norm(x + residual)), x + residual): the norm inside gate_up where tuned.
        hand_over (the next layer takes its norm handed over): the first may be InResidual,
        down_proj's output already added into the second."""
        act, residual = self.gate_up_proj.normed_swiglu(norm, x, residual)
        return self.down_proj.added_to(act, residual if hand_over else None), residual


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

    def takes_norm(self, rows: int) -> bool:
        """Whether qkv reads the layer's input norm handed over, at this many rows."""
        return self.self_attn.qkv_proj.takes_norm(rows)

    def forward(self, positions, hidden, residual, ctx: ForwardContext,
                hand_over: bool = False):
        """(hidden, residual) for the next layer; hand_over (the next layer takes its norm
        handed over, takes_norm): hidden may be InResidual, already added into residual."""
        # each norm runs inside the linear layer after it where start-up tuning found that
        # faster at one row (LinearBase.normed), or is handed over by the one before where
        # the one after takes it (InResidual: hidden already added into residual)
        qkv, residual = self.self_attn.qkv_proj.normed(self.input_layernorm, hidden, residual)
        mlp_takes = self.mlp.takes_norm(qkv.shape[0])
        hidden = self.self_attn.attend(positions, qkv, ctx, residual if mlp_takes else None)
        return self.mlp.normed(self.post_attention_layernorm, hidden, residual, hand_over)


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
        aux, rows = {}, input_ids.shape[0]
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = _stream(hidden, residual)
            # the norm handed over only to a layer that takes it (never to the final norm)
            hand_over = i + 1 < len(self.layers) and self.layers[i + 1].takes_norm(rows)
            hidden, residual = layer(positions, hidden, residual, ctx, hand_over)
        if self.aux_layers:  # in aux_layers' order, a layer named twice kept twice
            self.aux_hidden = [aux[i] for i in self.aux_layers]
        hidden, _ = apply_norm(self.norm, hidden, residual)
        return hidden


def _stream(hidden: torch.Tensor | InResidual, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream a layer receives, as a tensor of its own (the layers update the
    residual in place)."""
    if residual is None:
        return hidden
    return residual.clone() if isinstance(hidden, InResidual) else hidden + residual


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
