"""Weight loading: sharded checkpoints, tied embeddings, corrupt or incomplete files."""

import shutil

import pytest
import torch

from echo.config import EngineConfig
from echo.worker.model_loader import build_model
from tests.helpers import load_hf


def build(folder, **kwargs):
    config = EngineConfig.create(str(folder), device="cpu", **kwargs)
    return build_model(config.model, torch.device("cpu"))


def test_sharded_checkpoint_loads_every_weight(tiny_qwen3_untied):
    model, hf = build(tiny_qwen3_untied), load_hf(tiny_qwen3_untied)
    hf_layer = hf.model.layers[1]
    ours = model.model.layers[1]
    q, k, v = (hf_layer.self_attn.q_proj.weight, hf_layer.self_attn.k_proj.weight,
               hf_layer.self_attn.v_proj.weight)
    assert torch.equal(ours.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(ours.mlp.gate_up_proj.weight,
                       torch.cat([hf_layer.mlp.gate_proj.weight, hf_layer.mlp.up_proj.weight]))
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tied_embeddings_share_one_tensor(tiny_llama_tied):
    model = build(tiny_llama_tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_corrupt_safetensors_names_the_file(tiny_llama, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        build(folder)


def test_missing_weights_are_reported(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    shutil.copytree(tiny_llama, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 weight"):
        build(folder)


def test_dummy_weights_have_the_preset_shapes():
    config = EngineConfig.create("qwen3-0.6b", load_format="dummy", device="cpu",
                                 max_model_len=128, dtype="bfloat16")
    # build only the first layers' worth of checks: the full model is 0.6B params
    model = build_model(config.model, torch.device("meta"))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == ((16 + 2 * 8) * 128, 1024)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 3072, 1024)
    assert layer.self_attn.q_norm.weight.shape == (128,)
    assert model.lm_head.weight is model.model.embed_tokens.weight
