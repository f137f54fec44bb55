"""EAGLE-3 heads: a random head written by the test in the published checkpoint format loads,
and its forward (a prefill, then one more position over its KV cache) equals a PyTorch
reference written from that format; draft ids map to target ids through d2t."""

import json

import pytest
import torch
from safetensors.torch import save_file

from echo.attention.backend import AttentionMetadata
from echo.attention.torch_backend import TorchAttentionBackend
from echo.layers.attention import ForwardContext
from echo.models.arch import eagle3_target_layers
from echo.worker.kv_cache import KVCacheSpec
from echo.worker.model_loader import build_eagle3_head

H, INTER, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 16
VOCAB, DRAFT_VOCAB, EPS, THETA = 128, 40, 1e-6, 10000.0


def write_head(folder, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    def norm():
        return 1 + torch.randn(H, generator=g) * 0.1

    # the draft vocabulary: 40 target ids, ascending; d2t holds target id - draft id
    kept = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[kept] = True
    weights = {
        "fc.weight": rand(H, 3 * H),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": rand(INTER, H),
        "midlayer.mlp.up_proj.weight": rand(INTER, H),
        "midlayer.mlp.down_proj.weight": rand(H, INTER),
        "norm.weight": norm(),
        "lm_head.weight": rand(DRAFT_VOCAB, H),
        "d2t": kept - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB, "rms_norm_eps": EPS, "rope_theta": THETA,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
        "torch_dtype": "float32"}))
    return weights


def rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rotate(x, positions):
    """Llama's rotary embedding (halves rotated), x [tokens, heads, HEAD_DIM]."""
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = positions.float()[:, None] * inv[None, :]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference(w, embeds, hidden):
    """The head over one sequence from position 0, from the checkpoint's tensors: its output
    before the final norm, and its logits over the draft vocabulary."""
    tokens = embeds.shape[0]
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]),
                   rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    positions = torch.arange(tokens)
    q = rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(tokens, HEADS, HEAD_DIM),
               positions)
    k = rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(tokens, KV_HEADS, HEAD_DIM),
               positions)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(tokens, KV_HEADS, HEAD_DIM)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(tokens, tokens).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(tokens, -1)
    residual = attn @ w["midlayer.self_attn.o_proj.weight"].T + hidden
    m = rms(residual, w["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)
           * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    out = mlp + residual
    return out, rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


def context(head, query_lens: int, seq_len: int, caches) -> ForwardContext:
    first = seq_len - query_lens
    meta = AttentionMetadata(
        slot_mapping=torch.arange(first, seq_len), block_table=torch.tensor([[0, 1]],
                                                                            dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, query_lens], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32), max_seqlen_q=query_lens,
        max_seqlen_k=seq_len, no_cached_prefix=first == 0, query_lens_cpu=(query_lens,),
        seq_lens_cpu=(seq_len,))
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    return ForwardContext(backend, meta, caches)


def test_head_forward_equals_the_checkpoint_reference(tmp_path):
    w = write_head(tmp_path / "head")
    head = build_eagle3_head(tmp_path / "head", torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    tokens = 9
    embeds = torch.randn(tokens + 1, H, generator=g)
    # the three target layers' hidden states at the prompt's positions (layers 2, 16, 29 of a
    # 32-layer target)
    assert eagle3_target_layers(32) == (2, 16, 29)
    target_hidden = [torch.randn(tokens, H, generator=g) for _ in range(3)]
    caches = KVCacheSpec(1, 16, KV_HEADS, HEAD_DIM, torch.float32, "auto").allocate(
        2, torch.device("cpu"))
    with torch.inference_mode():
        fused = head.fuse(target_hidden)
        out = head(embeds[:tokens], fused, torch.arange(tokens),
                   context(head, tokens, tokens, caches))
        # the next position drafts from the head's own output at the last one, over the cache
        step = head(embeds[tokens:], out[-1:], torch.tensor([tokens]),
                    context(head, 1, tokens + 1, caches))
        logits = head.compute_logits(torch.cat([out, step]))
    ref_fused = torch.cat(target_hidden, -1) @ w["fc.weight"].T
    ref_out, ref_logits = reference(w, embeds, torch.cat([ref_fused, out[-1:]]))
    torch.testing.assert_close(fused, ref_fused, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([out, step]), ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    draft_ids = logits.argmax(-1)
    target_ids = head.to_target_ids(draft_ids)
    kept = torch.nonzero(w["t2d"]).flatten()
    assert torch.equal(target_ids, kept[draft_ids])  # the draft id's place among kept ids


def test_bad_head_folders_are_named(tmp_path):
    w = write_head(tmp_path / "head")
    del w["midlayer.hidden_norm.weight"]
    save_file(w, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks .*hidden_norm"):
        build_eagle3_head(tmp_path / "head", torch.float32, torch.device("cpu"))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps(
        {**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        build_eagle3_head(tmp_path / "head", torch.float32, torch.device("cpu"))
