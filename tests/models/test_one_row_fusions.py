"""The one-row kernels start-up tuning may give a decoder's layers (worker/linear_tuning.py):
the RMSNorm inside qkv's, gate/up's and a router's GEMV, SwiGLU inside gate/up's, assigned by
hand here as the tuning would (it needs a GPU to time them), through the model's own forward,
on the CPU under Triton's interpreter. A one-token prompt is the one-row step they serve;
logits against the same model without them and against transformers."""

import pytest
import torch

from echo.layers.linear import GateUpParallelLinear
from echo.models.qwen3_moe import Qwen3MoeSparseBlock
from echo.worker.linear_tuning import gemv, normed_gemv
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


def fuse(model, norm_inside: bool, swiglu_inside: bool, calls: list) -> int:
    """Give every layer that can take them the fused one-row kernels, each noting its calls
    in `calls`; how many were given."""

    def counted(kernel):
        def call(*args, **kwargs):
            calls.append(kernel)
            return kernel(*args, **kwargs)
        return call

    given = 0
    for layer in model.model.layers:
        if norm_inside:
            layer.self_attn.qkv_proj.normed_kernels[1] = counted(normed_gemv(*WHOLE_K))
            mlp = layer.mlp
            if isinstance(mlp, Qwen3MoeSparseBlock):
                mlp.gate.normed_kernels[1] = counted(normed_gemv(2, 64, True, 4))
            else:
                mlp.gate_up_proj.normed_kernels[1] = counted(normed_gemv(*WHOLE_K, swiglu=True))
            given += 2
        if swiglu_inside and isinstance(getattr(layer.mlp, "gate_up_proj", None),
                                        GateUpParallelLinear):
            layer.mlp.gate_up_proj.swiglu_kernels[1] = counted(gemv(8, 32, False, 4,
                                                                    swiglu=True))
            given += 1
    return given


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp("tiny_moe_fusions"))


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_moe"])
@pytest.mark.parametrize("norm_inside,swiglu_inside", [(True, False), (False, True)])
def test_one_token_logits_unchanged(fixture, norm_inside, swiglu_inside, request):
    folder = request.getfixturevalue(fixture)
    prompt = [[37]]
    plain = echo_logits(make_runner(folder), prefill_output(prompt))
    runner, calls = make_runner(folder), []
    given = fuse(runner.model, norm_inside, swiglu_inside, calls)
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
