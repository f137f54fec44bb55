"""EngineConfig: resolution of models, presets and defaults; errors that name the field."""

import json

import pytest

from echo.config import EngineConfig
from echo.models.arch import arch_from_hf_config


def test_tiny_folder_resolves_shapes(tiny_qwen3):
    config = EngineConfig.create(str(tiny_qwen3), device="cpu", max_model_len=256)
    arch = config.model.arch
    assert (arch.family, arch.num_heads, arch.num_kv_heads, arch.head_dim) == ("qwen3", 4, 2, 32)
    assert config.model.max_model_len == config.scheduler.max_model_len == 256
    assert config.model.dtype == "float32"  # auto on CPU
    assert config.device.attention_backend == "torch"


def test_presets_need_dummy_weights():
    with pytest.raises(ValueError, match="never downloads"):
        EngineConfig.create("qwen3-8b", device="cpu")
    config = EngineConfig.create("llama-3.1-8b", load_format="dummy", device="cpu")
    arch = config.model.arch
    assert arch.rope_scaling.rope_type == "llama3" and arch.rope_scaling.factor == 8.0
    assert arch.eos_token_ids == (128001, 128008, 128009)
    assert arch.head_dim == 128 and arch.num_kv_heads == 8


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        EngineConfig.create(str(missing))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        EngineConfig.create(str(tmp_path))


@pytest.mark.parametrize("field,value", [
    ("block_size", 7), ("gpu_memory_utilization", 1.5), ("max_num_seqs", 0),
    ("tensor_parallel_size", 3), ("dtype", "int4"), ("kv_cache_dtype", "fp8"),
    ("load_format", "pickle"), ("num_gpu_blocks_override", 0),
    ("data_parallel_size", 0), ("data_parallel_backend", "k8s"), ("router_policy", "random"),
    ("ray_address", 6379), ("num_scheduler_steps", 0), ("num_scheduler_steps", 65),
    ("grammar_processes", -1), ("grammar_processes", 1.0),
])
def test_bad_values_name_their_field(tiny_llama, field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig.create(str(tiny_llama), device="cpu", **{field: value})


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16", "int8"])
def test_kv_cache_dtypes_are_accepted(tiny_llama, kv_cache_dtype):
    config = EngineConfig.create(str(tiny_llama), device="cpu", kv_cache_dtype=kv_cache_dtype)
    assert config.cache.kv_cache_dtype == kv_cache_dtype


def test_cli_offers_the_same_kv_cache_dtypes():
    import argparse

    from echo.entrypoints.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    [action] = [a for a in parser._actions if a.dest == "kv_cache_dtype"]
    assert action.choices == ["auto", "bf16", "int8"]
    assert parser.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"


@pytest.mark.parametrize("field,value", [
    # each would pass the range check (2.0 == 2, True == 1) or fail it with a bare TypeError
    ("tensor_parallel_size", "2"), ("tensor_parallel_size", 2.0), ("tp", True),
    ("block_size", 16.0), ("max_num_seqs", "8"), ("max_num_batched_tokens", 1e4),
    ("num_gpu_blocks_override", 64.0), ("max_model_len", "256"), ("seed", 1.5),
    ("gpu_memory_utilization", "0.5"), ("enable_prefix_caching", "no"),
    ("async_scheduling", 0), ("enforce_eager", 1), ("data_parallel_size", 2.0),
    ("num_scheduler_steps", "8"),
])
def test_values_of_the_wrong_type_name_their_field(tiny_llama, field, value):
    name = {"tp": "tensor_parallel_size"}.get(field, field)
    with pytest.raises(ValueError, match=rf"^{name}: must be"):
        EngineConfig.create(str(tiny_llama), device="cpu", **{field: value})


def test_several_decode_steps_and_speculation_are_refused_together(tiny_llama):
    with pytest.raises(ValueError, match="^num_scheduler_steps: 8 cannot be combined with "
                                         "speculative_config"):
        EngineConfig.create(str(tiny_llama), device="cpu", num_scheduler_steps=8,
                            speculative_config={"method": "ngram"})


def test_engine_arguments_are_checked_before_the_model_is_resolved(tmp_path):
    # the model folder does not exist: the tp error comes first, not the missing model
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.create(str(tmp_path / "missing"), tensor_parallel_size=0)


def test_max_model_len_zero_is_refused_not_replaced(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len: must be >= 1"):
        EngineConfig.create(str(tiny_llama), device="cpu", max_model_len=0)


def test_unknown_argument_is_rejected(tiny_llama):
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.create(str(tiny_llama), max_num_seq=4)


@pytest.mark.parametrize("dtype, resolved", [("half", "float16"), ("float", "float32"),
                                             ("bfloat16", "bfloat16")])
def test_vllms_dtype_names_and_trust_remote_code_are_taken(tiny_llama, dtype, resolved):
    """vLLM's LLM(...) arguments as its users type them: dtype "half" and "float", and
    trust_remote_code (no effect: echo never runs a model's own code)."""
    config = EngineConfig.create(str(tiny_llama), device="cpu", dtype=dtype,
                                 trust_remote_code=True)
    assert config.model.dtype == resolved


def test_config_is_frozen(tiny_llama):
    config = EngineConfig.create(str(tiny_llama), device="cpu")
    with pytest.raises(AttributeError):
        config.cache.block_size = 32


def test_old_and_new_rope_forms_agree():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = arch_from_hf_config({**base, "rope_theta": 5e5,
                               "rope_scaling": {"rope_type": "llama3", **scaling}})
    new = arch_from_hf_config({**base, "rope_parameters": {"rope_type": "llama3",
                                                           "rope_theta": 5e5, **scaling}})
    assert old == new and old.rope_theta == 5e5
    # what echo cannot apply is refused, naming it, rather than run with plain RoPE
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        arch_from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope_scaling must be an object, got 'linear'"):
        arch_from_hf_config({**base, "rope_scaling": "linear"})


@pytest.mark.parametrize("field,value,message", [
    ("num_hidden_layers", 0, "num_hidden_layers must be a whole number >= 1, got 0"),
    ("num_attention_heads", 0, "num_attention_heads must be a whole number >= 1, got 0"),
    ("hidden_size", "eight", "hidden_size must be a whole number >= 1, got 'eight'"),
    ("vocab_size", 2.5, "vocab_size must be a whole number >= 1, got 2.5"),
    ("num_key_value_heads", 3, r"num_attention_heads \(2\) must be a multiple of "
                               r"num_key_value_heads \(3\)"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be > 0"),
])
def test_config_json_sizes_that_cannot_be_a_model_are_named(field, value, message):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    assert arch_from_hf_config(base).head_dim == 4  # hidden_size / num_attention_heads
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        arch_from_hf_config({**base, field: value})


def _tp_model(folder, **overrides):
    """A model folder with just config.json: the config never reads weights."""
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, **overrides}
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.mark.parametrize("overrides,tp,model_field", [
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "num_attention_heads"),
    # 3 KV heads on 2 ranks: neither an even split nor a whole number of replicas
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "num_key_value_heads"),
    ({"intermediate_size": 97}, 2, "intermediate_size"),
])
def test_tp_that_does_not_fit_the_model_names_both_fields(tmp_path, overrides, tp, model_field):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size: .*{model_field}"):
        EngineConfig.create(_tp_model(tmp_path, **overrides), device="cpu",
                            tensor_parallel_size=tp)


@pytest.mark.parametrize("overrides,tp", [
    ({"num_key_value_heads": 1}, 2),  # one KV head, replicated on both ranks
    ({}, 4),  # 2 KV heads, each replicated on 2 of the 4 ranks
    ({"vocab_size": 127}, 2),  # the vocab-parallel embedding pads the last rank's slice
])
def test_tp_that_fits_the_model_is_accepted(tmp_path, overrides, tp):
    config = EngineConfig.create(_tp_model(tmp_path, **overrides), device="cpu",
                                 tensor_parallel_size=tp)
    assert config.parallel.tensor_parallel_size == tp


def test_tp_larger_than_the_visible_gpus_is_refused_on_cuda_only(tmp_path, monkeypatch):
    import torch

    folder = _tp_model(tmp_path)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 .*1 CUDA device"):
        EngineConfig.create(folder, device="cuda", tensor_parallel_size=2)
    assert EngineConfig.create(folder, device="cuda", tp=1).parallel.tensor_parallel_size == 1
    # on CPU the ranks are processes sharing the host: no GPU count applies
    assert EngineConfig.create(folder, device="cpu", tp=2).parallel.tensor_parallel_size == 2
    # no GPU at all: the device asked for is what is wrong, not the rank count
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="device: cuda needs a CUDA GPU, but none is visible"):
        EngineConfig.create(folder, device="cuda")
