"""AWQ checkpoints (W4A16, AutoAWQ's "gemm" layout) of tiny random Llama and Qwen3, packed by the
tests' own packer (tests/kernels/test_awq.py, written from the format description): echo's
logits and greedy tokens equal transformers' model holding the same dequantized weights."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from echo import LLM
from tests.helpers import VOCAB, echo_greedy_tokens, hf_greedy_tokens, randomize_norms
from tests.kernels.test_awq import pack_awq, quantize_rtn
from tests.models.test_logits_vs_transformers import (
    PROMPTS,
    assert_prefill_logits_match,
    echo_logits,
    make_runner,
    prefill_output,
)

GROUP = 32
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
              "version": "gemm"}


def write_quantized_model(folder, family: str, quant_config: dict, quantize, seed: int = 0,
                          **dims):
    """A tiny random Llama or Qwen3 saved with its linear layers quantized: (the folder,
    transformers' model holding the dequantized weights). quantize(name, weight [out, in])
    gives the layer's checkpoint tensors (suffix -> tensor) and its dequantized weight, or None
    to keep the layer dense. dims: config fields other than the tiny defaults."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  rms_norm_eps=1e-6) | dims
    if family == "qwen3":
        config, model_cls = Qwen3Config(head_dim=32, rope_theta=10000.0, **common), \
            Qwen3ForCausalLM
    else:
        config, model_cls = LlamaConfig(rope_theta=10000.0, **common), LlamaForCausalLM
    torch.manual_seed(seed)
    model = randomize_norms(model_cls(config).to(torch.float32).eval())
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            quantized = (quantize(name, param.detach())
                         if any(f".{p}." in name for p in QUANTIZED) else None)
            if quantized is None:
                tensors[name] = param.detach().clone().contiguous()
                continue
            layer_tensors, dequantized = quantized
            base = name.removesuffix(".weight")
            tensors.update({f"{base}.{suffix}": t for suffix, t in layer_tensors.items()})
            param.copy_(dequantized)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    cfg = {**config.to_dict(), "architectures": [model_cls.__name__],
           "quantization_config": quant_config, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, model


def write_awq_model(folder, family: str, group: int = GROUP, **dims):
    """(echo's AWQ folder, transformers' model with the dequantized weights)."""

    def quantize(name, weight):
        w = weight.T.contiguous()  # AWQ multiplies x @ W with W [in, out]
        q, z, s = quantize_rtn(w, group)
        groups = torch.arange(w.shape[0]) // group
        return ({"qweight": pack_awq(q), "qzeros": pack_awq(z), "scales": s},
                ((q - z[groups]).float() * s.float()[groups]).T)

    return write_quantized_model(folder, family, {**AWQ_CONFIG, "group_size": group}, quantize,
                                 **dims)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def awq_model(request, tmp_path_factory):
    return write_awq_model(tmp_path_factory.mktemp(f"awq_{request.param}"), request.param)


def test_prefill_logits_match_transformers_with_the_dequantized_weights(awq_model):
    folder, hf = awq_model
    assert_prefill_logits_match(echo_logits(make_runner(folder), prefill_output(PROMPTS)), hf)


def assert_greedy_like_transformers(folder, hf, **engine_args) -> None:
    """16 greedy tokens after a 30-token prompt, echo's (with engine_args) and transformers'."""
    prompt = list(range(10, 40))
    assert echo_greedy_tokens(folder, [prompt], 16, **engine_args) == \
        [hf_greedy_tokens(hf, prompt, 16)], engine_args


def test_greedy_tokens_equal_transformers_at_one_and_two_ranks(awq_model):
    for tp in (1, 2):
        assert_greedy_like_transformers(*awq_model, tensor_parallel_size=tp)


@pytest.mark.parametrize("change,field", [
    ({"bits": 8}, "quantization_config.bits"),
    ({"desc_act": True}, "quantization_config.desc_act"),
    ({"version": "gemv"}, "quantization_config.version"),
    ({"group_size": 48}, "quantization_config.group_size"),
    ({"zero_point": False}, "quantization_config.zero_point"),
    ({"quant_method": "gptq"}, "quantization_config.quant_method"),
])
def test_unsupported_quantization_configs_name_the_field(awq_model, tmp_path, change, field):
    folder, _ = awq_model
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {**AWQ_CONFIG, **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        LLM(str(tmp_path), device="cpu", num_gpu_blocks_override=16)


def assert_load_refused(folder, tmp_path, tensors: dict, match: str) -> None:
    """folder's config.json with these tensors instead of its own: loading names `match`."""
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), device="cpu", num_gpu_blocks_override=16)


def test_missing_or_misshapen_awq_tensors_name_the_tensor(awq_model, tmp_path):
    folder, _ = awq_model
    tensors = load_file(folder / "model.safetensors")
    scales = "model.layers.0.self_attn.o_proj.scales"
    assert_load_refused(folder, tmp_path, {k: v for k, v in tensors.items() if k != scales},
                        "o_proj.scales")
    qweight = "model.layers.1.mlp.down_proj.qweight"
    misshapen = {**tensors, qweight: tensors[qweight][:, :4].contiguous()}
    assert_load_refused(folder, tmp_path, misshapen, "down_proj.qweight")


def test_the_tensor_core_layout_is_a_gpu_choice(awq_model, monkeypatch):
    """ECHO_AWQ_MMA=1 (the default) repacks AWQ weights on a GPU only: on the CPU the layers
    keep AutoAWQ's layout and the tokens stay transformers'."""
    monkeypatch.setenv("ECHO_AWQ_MMA", "1")
    assert_greedy_like_transformers(*awq_model)


def two_step_logits_against_transformers(folder, hf, device: str, dtype: str,
                                        scale: float) -> list:
    """PROMPTS in two steps, their first 10 tokens (27 rows), then the rest of the two longer
    ones (92 rows): each step's logits against transformers' to within `scale` times their
    largest. The runner's AWQ linear layers."""
    from echo.config import EngineConfig
    from echo.core.sched_output import CachedRequestData, SchedulerOutput
    from echo.layers.linear import LinearBase
    from echo.worker.model_runner import ModelRunner
    from tests.models.test_logits_vs_transformers import BLOCK, hf_logits

    config = EngineConfig.create(str(folder), device=device, dtype=dtype, block_size=BLOCK,
                                 num_gpu_blocks_override=64, max_num_seqs=8)
    runner = ModelRunner(config)
    runner.init_kv_cache(64)
    chunk = 10
    first = echo_logits(runner, prefill_output(PROMPTS, chunk=chunk)).float().cpu()
    ids, longer = ["r1", "r2"], PROMPTS[1:3]
    rest = {i: len(p) - chunk for i, p in zip(ids, longer)}
    second = echo_logits(runner, SchedulerOutput(
        step_id=1, scheduled_cached_reqs=CachedRequestData(ids, [[], []], [chunk, chunk]),
        num_scheduled_tokens=rest, total_num_scheduled_tokens=sum(rest.values()))).float().cpu()
    want_first = torch.cat([hf_logits(hf, p)[:chunk] for p in PROMPTS])
    want_second = torch.cat([hf_logits(hf, p)[chunk:] for p in longer])
    for got, want in ((first, want_first), (second, want_second)):
        assert got.shape == want.shape
        tolerance = scale * want.abs().max().item()
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
    return [m for m in runner.model.modules() if isinstance(m, LinearBase) and m.quant]


def tensor_core_shaped_awq_model(folder):
    """A Llama whose every AWQ layer the tensor-core layout takes: outputs multiples of 128,
    groups of 64."""
    return write_awq_model(folder, "llama", group=64, hidden_size=256, intermediate_size=512)


def test_two_steps_of_awq_logits_on_the_cpu(tmp_path):
    """The two-step check the GPU test below runs, on the CPU in float32 (AutoAWQ's layout)."""
    layers = two_step_logits_against_transformers(*tensor_core_shaped_awq_model(tmp_path), "cpu",
                                                  "float32", 1e-4)
    assert len(layers) == 8 and not any(m.awq_repacked for m in layers)


@pytest.mark.gpu
@pytest.mark.parametrize("sum_inside", ["0", "1"])
def test_gpu_tensor_core_layout_logits_match_transformers(tmp_path, monkeypatch, sum_inside):
    """In fp16 on the GPU every layer repacked: 27 rows through awq_mma_gemv (its splits
    summed by a second launch, or inside it: ECHO_AWQ_SUM_INSIDE), 92 through
    awq_gemm_repacked, against transformers' float32 model holding the dequantized weights (a
    tolerance of fp16's scale, far under what a misplaced weight or input gives)."""
    monkeypatch.setenv("ECHO_AWQ_SUM_INSIDE", sum_inside)
    layers = two_step_logits_against_transformers(*tensor_core_shaped_awq_model(tmp_path),
                                                  "cuda", "float16", 2e-2)
    assert len(layers) == 8 and all(m.awq_repacked for m in layers)
    assert all((m.awq_arrivals is not None) == (sum_inside == "1") for m in layers)


@pytest.mark.gpu
def test_gpu_kernels_and_graphs_give_transformers_greedy_tokens(awq_model):
    """On the GPU the linear layers run awq_gemv / awq_gemm, decodes replay CUDA graphs."""
    assert_greedy_like_transformers(*awq_model, device="cuda", dtype="float32")



def test_the_quantization_argument_is_checked_against_the_checkpoint(awq_model, tiny_llama):
    from echo.config import EngineConfig

    folder, _ = awq_model
    config = EngineConfig.create(str(folder), device="cpu", quantization="awq")
    assert config.model.arch.quantization.group_size == GROUP
    # vLLM's name of its kernel for AWQ checkpoints reads the same checkpoint
    marlin = EngineConfig.create(str(folder), device="cpu", quantization="awq_marlin")
    assert marlin.model.arch.quantization == config.model.arch.quantization
    with pytest.raises(ValueError, match="quantization: 'awq' given"):
        EngineConfig.create(str(tiny_llama), device="cpu", quantization="awq_marlin")
    with pytest.raises(ValueError, match="quantization: 'awq' given"):
        EngineConfig.create(str(tiny_llama), device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig.create(str(folder), device="cpu", quantization="gptq")


def test_the_awq_presets_weigh_what_a_4_bit_checkpoint_weighs():
    """The shapes alone (meta tensors) of the benchmarks' llama-3.1-8b-awq preset: 5.73 GB, the
    size of a published 4-bit group-128 AWQ checkpoint of Llama-3.1-8B-Instruct, of which a
    decode step reads all but the embedding table (~4.6 GB, the issue's floor)."""
    from echo.config import EngineConfig
    from echo.models.registry import model_class

    config = EngineConfig.create("llama-3.1-8b-awq", load_format="dummy", device="cpu",
                                 dtype="float16").model
    assert config.arch.quantization.group_size == 128
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("meta"):
            model = model_class(config.arch.family)(config.arch)
    finally:
        torch.set_default_dtype(previous)
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    total = sum(sizes.values())
    read = total - sum(size for name, size in sizes.items() if "embed_tokens" in name)
    assert abs(total / 1e9 - 5.73) < 0.02, total
    assert abs(read / 1e9 - 4.6) < 0.1, read
