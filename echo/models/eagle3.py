"""EAGLE-3 draft heads in the checkpoint format published for Llama-3.1-8B and Qwen3-8B
(config.json architectures ["LlamaForCausalLMEagle3"], one decoder layer, draft_vocab_size).

The head drafts from the target's own hidden states. At the first draft position its input
hidden state is `fc` over the concatenation of three target layers' hidden states (the
residual stream entering layers 2, L // 2 and L - 3 of an L-layer target, vLLM's choice for
Llama); at later positions it is the head's own output before the final norm. Its one decoder
layer (`midlayer`) normalizes the token's embedding (the target's embedding table: the head has
none of its own) and the hidden state separately, concatenates them (embedding first) into the
2 * hidden input of its q/k/v projections, and continues as a Llama layer (o_proj back to
hidden, the incoming hidden state as the residual, SwiGLU MLP). Its LM head covers a draft
vocabulary; `d2t` maps draft id i to target id i + d2t[i] (`t2d`, the target ids that have a
draft id, is kept only because checkpoints hold it).

Tensor names are the checkpoint's: fc.weight, midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v,o}_proj.weight,
midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight, d2t, t2d.

The engine runs it as speculative method eagle3 (echo/worker/eagle3_drafter.py).
"""

import torch
from torch import nn

from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.attention import ForwardContext
from echo.layers.embedding import ParallelLMHead
from echo.layers.layernorm import RMSNorm
from echo.layers.linear import QKVParallelLinear, ReplicatedLinear
from echo.layers.rotary import RotaryEmbedding
from echo.models.arch import Eagle3Config, ModelArch
from echo.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q/k/v read the concatenated [embedding, hidden] (2 * hidden)."""

    def __init__(self, arch: ModelArch, rope: RotaryEmbedding, tp: TPGroup):
        super().__init__(arch, 0, rope, tp)
        self.qkv_proj = QKVParallelLinear(2 * arch.hidden_size, arch.head_dim, arch.num_heads,
                                          arch.num_kv_heads, arch.attention_bias, tp)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, rope: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        self.self_attn = Eagle3Attention(arch, rope, tp)
        self.mlp = LlamaMLP(arch, tp, "midlayer.mlp")
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, embeds, hidden, ctx: ForwardContext) -> torch.Tensor:
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class Eagle3Head(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id): a Llama layer's
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: Eagle3Config, tp: TPGroup = SINGLE,
                 max_position: int | None = None):
        super().__init__()
        arch = config.arch
        self.arch, self.config = arch, config
        self.fc = ReplicatedLinear(3 * config.target_hidden_size, arch.hidden_size, False, tp)
        rope = RotaryEmbedding(arch.head_dim, max_position or arch.max_position_embeddings,
                               arch.rope_theta, arch.rope_scaling)
        self.midlayer = Eagle3DecoderLayer(arch, rope, tp)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, arch.hidden_size, tp)
        no_grad = {"requires_grad": False}
        self.d2t = nn.Parameter(torch.zeros(config.draft_vocab_size, dtype=torch.int64),
                                **no_grad)
        self.t2d = nn.Parameter(torch.zeros(arch.vocab_size, dtype=torch.bool), **no_grad)

    def fuse(self, target_hidden: list[torch.Tensor]) -> torch.Tensor:
        """The first draft position's hidden state from the three target layers' (in
        eagle3_target_layers order), each [tokens, target hidden]."""
        return self.fc(torch.cat(target_hidden, dim=-1))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """The head's output before its final norm, [tokens, hidden]: the next position's
        input hidden state, and compute_logits' input."""
        return self.midlayer(positions, embeds, hidden, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
