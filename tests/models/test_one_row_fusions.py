"""The one-row kernels start-up tuning may give a decoder's layers (worker/linear_tuning.py):
the RMSNorm inside qkv's, gate/up's and a router's GEMV, SwiGLU inside gate/up's, the norm
handed over (o_proj and down adding into the residual stream, qkv and gate/up normalising it
from their sums of squares), assigned by hand here as the tuning would (it needs a GPU to time
them), through the model's own forward, on the CPU under Triton's interpreter. A one-token
prompt is the one-row step they serve; logits against the same model without them and against
transformers."""

import importlib

import pytest
import torch

from echo.models.qwen3_moe import Qwen3MoeSparseBlock
from echo.worker.linear_tuning import gemv, into_gemv, normed_gemv, prenormed_gemv
from tests.helpers import load_hf
from tests.models.test_logits_vs_transformers import (
    echo_logits,
    hf_logits,
    make_runner,
    prefill_output,
)
from tests.models.test_qwen3_moe import write_tiny_moe

# whole-K tiles (the fused norm needs a row at once) at the tiny models' hidden size of 64
WHOLE_K = (8, 64, True, 4)


def fuse(model, norm_inside: bool, swiglu_inside: bool, calls: list,
         handover: bool = False) -> int:
    """Give every layer that can take them the fused one-row kernels, each noting its calls
    in `calls`; how many calls a one-row forward makes of them (the first layer's qkv gets
    no norm handed over: the embedding comes before it)."""

    def counted(kernel):
        def call(*args, **kwargs):
            calls.append(kernel)
            return kernel(*args, **kwargs)
        return call

    layers = model.model.layers
    given = 0
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        dense = not isinstance(mlp, Qwen3MoeSparseBlock)
        # handed over to every qkv but the first (the embedding comes before it) and to dense
        # layers' gate/up; never to a router, which normalises for itself, or the final norm
        handed_in, hands_on = handover and i > 0, handover and i + 1 < len(layers)
        if handover:
            attn.o_proj.into_kernels[1] = counted(into_gemv(8, 32, True, 4))
            attn.qkv_proj.prenormed_kernels[1] = counted(prenormed_gemv(8, 32, False, 4))
            if dense:
                # over the whole of the intermediate 96 (padded to 128), in runs of blocks
                mlp.down_proj.into_kernels[1] = counted(into_gemv(4, 128, True, 4, 1))
                mlp.gate_up_proj.prenormed_kernels[1] = counted(
                    prenormed_gemv(*WHOLE_K, swiglu=True))
            else:  # the experts' kernel adds into the stream (the next qkv's call shows it)
                mlp.experts.hands_over = True
            given += handed_in + 2 * dense + (dense and hands_on)
        if norm_inside:
            attn.qkv_proj.normed_kernels[1] = counted(normed_gemv(*WHOLE_K))
            if dense:
                mlp.gate_up_proj.normed_kernels[1] = counted(normed_gemv(*WHOLE_K, swiglu=True))
            else:
                mlp.gate.normed_kernels[1] = counted(normed_gemv(2, 64, True, 4))
            # a norm handed over goes before the norm inside
            given += (not handed_in) + (not (handover and dense))
        if swiglu_inside and dense:
            mlp.gate_up_proj.swiglu_kernels[1] = counted(gemv(8, 32, False, 4, swiglu=True))
            given += 1
    return given


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp("tiny_moe_fusions"))


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_moe"])
@pytest.mark.parametrize("norm_inside,swiglu_inside,handover", [
    (True, False, False), (False, True, False), (False, False, True), (True, False, True)])
def test_one_token_logits_unchanged(fixture, norm_inside, swiglu_inside, handover, request):
    # handed over and inside together: a MoE router's norm inside, of the stream o_proj added
    folder = request.getfixturevalue(fixture)
    prompt = [[37]]
    plain = echo_logits(make_runner(folder), prefill_output(prompt))
    runner, calls = make_runner(folder), []
    given = fuse(runner.model, norm_inside, swiglu_inside, calls, handover)
    fused = echo_logits(runner, prefill_output(prompt))
    assert given > 0 and len(calls) == given  # each kernel ran once, none fell back
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, hf_logits(load_hf(folder), prompt[0]), atol=1e-4,
                               rtol=1e-4)
    # several rows take the layers' usual path: the same logits as without the kernels
    prompts, calls[:] = [[37, 5, 9]], []
    torch.testing.assert_close(echo_logits(runner, prefill_output(prompts, step_id=1)),
                               echo_logits(make_runner(folder), prefill_output(prompts)),
                               atol=1e-5, rtol=1e-5)
    assert calls == []


@pytest.mark.parametrize("handover", [False, True])
def test_moe_router_routes_inside(tiny_moe, handover, monkeypatch):
    # the router's GEMV with the norm inside also routes in its last program: the experts run
    # from its routing (no moe_routing launch at one row), the logits as without it and as
    # transformers'
    # the module (echo_kernels' own `fused_moe` attribute is the function of that name)
    moe_kernels = importlib.import_module("echo_kernels.fused_moe")
    prompt = [[37]]
    plain = echo_logits(make_runner(tiny_moe), prefill_output(prompt))
    runner = make_runner(tiny_moe)
    fuse(runner.model, True, False, [], handover)
    sparse = [layer.mlp for layer in runner.model.model.layers
              if isinstance(layer.mlp, Qwen3MoeSparseBlock)]
    for block in sparse:
        block.experts.route_arrivals = torch.zeros(1, dtype=torch.int32)
    launches, routed = [], []

    def counted(name, fn, calls):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(moe_kernels, "moe_routing",
                        counted("routing", moe_kernels.moe_routing, launches))
    monkeypatch.setattr(moe_kernels, "fused_moe_routed",
                        counted("experts", moe_kernels.fused_moe_routed, routed))
    fused = echo_logits(runner, prefill_output(prompt))
    assert launches == [] and len(routed) == len(sparse) > 0
    assert all(block.experts.route_arrivals.item() == 0 for block in sparse)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, hf_logits(load_hf(tiny_moe), prompt[0]), atol=1e-4,
                               rtol=1e-4)
