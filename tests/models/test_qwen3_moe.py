"""Qwen3-MoE against transformers' own implementation: tiny random configs saved by
transformers (8 experts, top-2, a dense layer among the sparse ones, GQA), float32 on CPU."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from echo.models.arch import arch_from_hf_config
from tests.helpers import VOCAB, echo_greedy_tokens, hf_greedy_tokens, load_hf, randomize_norms
from tests.models.test_logits_vs_transformers import (
    PROMPTS,
    assert_prefill_logits_match,
    echo_logits,
    make_runner,
    prefill_output,
)


def write_tiny_moe(folder, norm_topk_prob: bool = True, seed: int = 0,
                   mlp_only_layers: tuple[int, ...] = (1,)):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=list(mlp_only_layers), max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rms_norm_eps=1e-6, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = randomize_norms(Qwen3MoeForCausalLM(config).to(torch.float32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate.weight" in name:  # a router that prefers some experts clearly
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"))


def test_config_reads_the_experts_under_either_name(tiny_moe):
    cfg = json.loads((tiny_moe / "config.json").read_text())
    arch = arch_from_hf_config(cfg)
    assert (arch.family, arch.num_experts, arch.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert [arch.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    other = {k: v for k, v in cfg.items() if k not in ("num_experts", "num_local_experts")}
    assert arch_from_hf_config({**other, "num_experts": 8}).num_experts == 8
    with pytest.raises(ValueError, match="num_experts"):
        arch_from_hf_config(other)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_prefill_logits_match_transformers(tmp_path, norm_topk_prob):
    folder = write_tiny_moe(tmp_path, norm_topk_prob)
    runner, hf = make_runner(folder), load_hf(folder)
    assert_prefill_logits_match(echo_logits(runner, prefill_output(PROMPTS)), hf)


def test_packed_expert_layout_loads_the_same(tiny_moe, tmp_path):
    """The packed layout ([E, 2I, H] gate_up, [E, H, I] down) gives the same model."""
    tensors = load_file(tiny_moe / "model.safetensors")
    packed = {}
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"),
                              tensors.pop(f"{prefix}.{e}.up_proj.weight")]) for e in range(8)]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(8)]
        packed[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        packed[f"{prefix}.down_proj"] = torch.stack(down)
    save_file({**tensors, **packed}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_moe / "config.json").read_text())
    expected = echo_logits(make_runner(tiny_moe), prefill_output(PROMPTS[:2]))
    torch.testing.assert_close(echo_logits(make_runner(tmp_path), prefill_output(PROMPTS[:2])),
                               expected)


def test_greedy_tokens_equal_transformers_and_tensor_parallel_equals_one_rank(tiny_moe):
    hf = load_hf(tiny_moe)
    prompts = [[1, 17, 42, 99, 5], list(range(10, 40))]
    expected = [hf_greedy_tokens(hf, prompt, 32) for prompt in prompts]
    for tp in (1, 2):
        assert echo_greedy_tokens(tiny_moe, prompts, 32, tensor_parallel_size=tp) == expected, \
            f"tensor_parallel_size={tp}"


@pytest.mark.parametrize("preset,billions", [("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.1)])
def test_presets_have_the_published_parameter_counts(preset, billions):
    """The shapes alone (meta tensors): Qwen3-30B-A3B has 30.5 B parameters, -235B-A22B 235 B
    (their model cards)."""
    from echo.config import EngineConfig
    from echo.models.registry import model_class

    arch = EngineConfig.create(preset, load_format="dummy", device="cpu").model.arch
    with torch.device("meta"):
        model = model_class(arch.family)(arch)
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / 1e9 - billions) < 0.1 * billions / 30, total


@pytest.mark.gpu
def test_gpu_kernels_and_graphs_give_transformers_greedy_tokens(tiny_moe):
    """On the GPU the routing and experts are echo_kernels.fused_moe's, decodes replay CUDA
    graphs; float32 so the tokens can be compared exactly."""
    prompt = list(range(10, 40))
    expected = hf_greedy_tokens(load_hf(tiny_moe), prompt, 32)
    assert echo_greedy_tokens(tiny_moe, [prompt], 32, device="cuda", dtype="float32") == \
        [expected]
