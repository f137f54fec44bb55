"""compressed-tensors' W4A16 "pack-quantized" checkpoints (llm-compressor's format) of tiny random
Llama and Qwen3, symmetric and with zero points, packed by the tests' own packer (written from
the format description): echo's logits and greedy tokens equal transformers' model holding the
same dequantized weights; TP slices of the converted tensors equal slices of the whole; every
unsupported field and tensor is named."""

import json

import pytest
import torch
from safetensors.torch import load_file

from echo import LLM
from echo.layers.compressed_tensors import AwqView
from tests.kernels.test_awq import quantize_rtn
from tests.models.test_awq_models import (
    assert_greedy_like_transformers,
    assert_load_refused,
    write_quantized_model,
)
from tests.models.test_logits_vs_transformers import (
    PROMPTS,
    assert_prefill_logits_match,
    echo_logits,
    make_runner,
    prefill_output,
)

GROUP = 32
DENSE_LAYER = "model.layers.1.mlp.down_proj"  # left out by an "re:" ignore rule


def ct_config(symmetric: bool) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "ignore": ["lm_head", r"re:.*layers\.1\.mlp\.down_proj$"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                            "strategy": "group", "group_size": GROUP, "dynamic": False,
                            "actorder": None, "observer": "minmax"}}}}


def pack_ct(values: torch.Tensor, dim: int) -> torch.Tensor:
    """int [R, C] of 0..15 -> int32 packed along dim, compressed-tensors' way: nibble i (bits
    4i..4i+3) of element j along dim holds index 8j + i."""
    moved = values.long().movedim(dim, -1)
    nibbles = moved.reshape(*moved.shape[:-1], -1, 8)
    packed = (nibbles << (4 * torch.arange(8))).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def quantize(w: torch.Tensor, symmetric: bool) -> tuple[dict, torch.Tensor]:
    """w [out, in] -> (the layer's pack-quantized tensors, the dequantized w)."""
    if symmetric:  # q in -8..7, stored as q + 8; W = q * s
        groups = w.reshape(w.shape[0], -1, GROUP)
        s = (groups.abs().amax(-1) / 7).clamp_min(1e-5).to(torch.float16)
        q = torch.round(groups / s.float()[..., None]).clamp(-8, 7)
        dequant = (q * s.float()[..., None]).reshape(w.shape)
        return {"weight_packed": pack_ct((q + 8).reshape(w.shape), 1), "weight_scale": s,
                "weight_shape": torch.tensor(list(w.shape))}, dequant
    q, z, s = quantize_rtn(w.T, GROUP)  # unsigned q and z in 0..15 over [in, out]: both + 8
    rows = torch.arange(w.shape[1]) // GROUP
    dequant = ((q - z[rows]).float() * s.float()[rows]).T
    return {"weight_packed": pack_ct(q.T, 1), "weight_scale": s.T.contiguous(),
            "weight_zero_point": pack_ct(z.T, 0), "weight_shape": torch.tensor(list(w.shape))}, \
        dequant


def write_ct_model(folder, family: str, symmetric: bool):
    """(echo's folder, transformers' model with the dequantized weights)."""

    def quantize_layer(name, weight):
        return None if name.removesuffix(".weight") == DENSE_LAYER else quantize(weight,
                                                                                  symmetric)

    return write_quantized_model(folder, family, ct_config(symmetric), quantize_layer, seed=1)


@pytest.fixture(scope="module", params=[("llama", True), ("qwen3", False)],
                ids=["llama-symmetric", "qwen3-zero-points"])
def ct_model(request, tmp_path_factory):
    family, symmetric = request.param
    return write_ct_model(tmp_path_factory.mktemp(f"ct_{family}"), family, symmetric)


def test_prefill_logits_match_transformers_with_the_dequantized_weights(ct_model):
    folder, hf = ct_model
    runner = make_runner(folder)
    quant = runner.model.model.layers[0].mlp.down_proj.quant
    assert quant is not None and runner.model.model.layers[1].mlp.down_proj.quant is None
    assert_prefill_logits_match(echo_logits(runner, prefill_output(PROMPTS)), hf)


def test_greedy_tokens_equal_transformers_at_one_and_two_ranks(ct_model):
    for tp in (1, 2):
        assert_greedy_like_transformers(*ct_model, tensor_parallel_size=tp)


def test_a_ranks_slice_of_a_converted_tensor_is_the_same_slice_of_the_whole(ct_model):
    folder, _ = ct_model
    tensors = load_file(folder / "model.safetensors")
    prefix = "model.layers.0.mlp.gate_proj."
    kinds = [("qweight", "weight_packed"), ("scales", "weight_scale"),
             ("midpoints", "weight_scale"), ("qzeros", "weight_zero_point")]
    for kind, suffix in kinds:
        if prefix + suffix not in tensors:  # a symmetric checkpoint has no zero points
            continue
        view = AwqView(kind, tensors[prefix + suffix], suffix, torch.device("cpu"))
        full = view.whole()
        assert full.shape == view.shape
        for dim in (0, 1):
            half = view.shape[dim] // 2
            torch.testing.assert_close(view.narrow(dim, half, half),
                                       full.narrow(dim, half, half))


def test_packs_follow_awqs_order_and_symmetric_zero_points_are_eights():
    """Hand-computed. weight_packed: 8 output rows of 8 inputs, row r holding r at every input
    (each nibble of its int32). AWQ's qweight: 8 input rows of one int32 over outputs 0..7 whose
    nibble i holds output (0, 2, 4, 6, 1, 3, 5, 7)[i], here that value: 0x75316420.
    weight_zero_point [1 pack of 8 outputs, 2 groups]: nibble i is output i's zero, i in group 0
    and 7 - i in group 1; AWQ's qzeros [2 groups, 1 pack] read the same order."""
    cpu = torch.device("cpu")
    rows = torch.tensor([[r * 0x11111111] for r in range(8)], dtype=torch.int32)
    assert AwqView("qweight", rows, "w", cpu).whole().tolist() == [[0x75316420]] * 8
    zero_points = torch.tensor([[0x76543210, 0x01234567]], dtype=torch.int32)
    assert AwqView("qzeros", zero_points, "z", cpu).whole().tolist() == [[0x75316420],
                                                                          [0x02461357]]
    scales = torch.ones(16, 2, dtype=torch.float16)  # 16 outputs, 2 groups
    zeros = AwqView("midpoints", scales, "s", cpu).whole()
    assert zeros.shape == (2, 2) and (zeros == 0x88888888 - 2**32).all()


@pytest.mark.parametrize("change,field", [
    ({"format": "int-quantized"}, "quantization_config.format"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "quantization_config.kv_cache_scheme"),
    ({"weights": {"num_bits": 8}}, "weights.num_bits"),
    ({"weights": {"actorder": "group"}}, "weights.actorder"),
    ({"weights": {"strategy": "channel"}}, "weights.strategy"),
    ({"weights": {"group_size": 48}}, "weights.group_size"),
    ({"weights": {"type": "float"}}, "weights.type"),
    ({"input_activations": {"num_bits": 8}}, "input_activations"),
    ({"targets": ["re:.*mlp.*"]}, "targets"),
    ({"second_group": True}, "quantization_config.config_groups"),
    ({"ignore": ["re:(unclosed"]}, "quantization_config.ignore"),
])
def test_unsupported_compressed_tensors_configs_name_the_field(ct_model, tmp_path, change,
                                                               field):
    folder, _ = ct_model
    cfg = json.loads((folder / "config.json").read_text())
    quant = cfg["quantization_config"]
    group = quant["config_groups"]["group_0"]
    for key, value in change.items():
        if key == "weights":
            group["weights"].update(value)
        elif key == "second_group":
            quant["config_groups"]["group_1"] = group
        elif key in ("input_activations", "targets"):
            group[key] = value
        else:
            quant[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        LLM(str(tmp_path), device="cpu", num_gpu_blocks_override=16)


def test_act_order_and_misshapen_tensors_name_the_checkpoint_tensor(ct_model, tmp_path):
    folder, _ = ct_model
    tensors = load_file(folder / "model.safetensors")
    g_idx = "model.layers.0.self_attn.o_proj.weight_g_idx"
    assert_load_refused(folder, tmp_path, {**tensors, g_idx: torch.zeros(64, dtype=torch.int32)},
                        "o_proj.weight_g_idx")
    packed = "model.layers.0.mlp.down_proj.weight_packed"
    assert_load_refused(folder, tmp_path, {**tensors, packed: tensors[packed][:, :4].contiguous()},
                        "down_proj.weight_packed")


def test_the_quantization_argument_names_the_checkpoints_method(ct_model):
    from echo.config import EngineConfig

    folder, _ = ct_model
    config = EngineConfig.create(str(folder), device="cpu", quantization="compressed-tensors")
    assert config.model.arch.quantization.group_size == GROUP
    with pytest.raises(ValueError, match="quantization: 'awq' given, but .* 'compressed-tensors'"):
        EngineConfig.create(str(folder), device="cpu", quantization="awq")


@pytest.mark.gpu
def test_gpu_kernels_and_graphs_give_transformers_greedy_tokens(ct_model):
    """On the GPU the tensors are converted on the device and run awq_gemv / awq_gemm."""
    assert_greedy_like_transformers(*ct_model, device="cuda", dtype="float32")
