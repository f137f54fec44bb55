"""The persistent decode step inside the engine's model: a prompt's last token decoded over the
cache its prefix left, against transformers' logits for the whole prompt (float32, CPU: the
kernel's phases through Triton's interpreter)."""

import pytest
import torch

from echo.core.sched_output import CachedRequestData, SchedulerOutput
from echo.layers.attention import ForwardContext
from echo.worker.persistent_decoder import PersistentDecoder, unsupported_reason
from echo_kernels.persistent_decode import SYNC_ERROR
from tests.helpers import echo_greedy_tokens, hf_greedy_tokens, load_hf
from tests.models.test_awq_models import write_awq_model
from tests.models.test_logits_vs_transformers import (
    BLOCK,
    PROMPTS,
    echo_logits,
    hf_logits,
    make_runner,
    prefill_output,
)
from tests.models.test_qwen3_moe import write_tiny_moe


def decode_last_token(runner, prompt: list[int]) -> torch.Tensor:
    """The prefix through the runner's own forward, then the last token as a one-token step
    through the persistent decoder: its logits [vocab]."""
    echo_logits(runner, prefill_output([prompt], chunk=len(prompt) - 1))
    step = SchedulerOutput(
        step_id=1, scheduled_cached_reqs=CachedRequestData(["r0"], [[]], [len(prompt) - 1]),
        num_scheduled_tokens={"r0": 1}, total_num_scheduled_tokens=1)
    runner.input_batch.update(step, runner.vocab_size)
    input_ids, positions, meta = runner.buffers.load(runner.input_batch.prepare(step))
    decoder = PersistentDecoder(runner.model, runner.kv_caches, BLOCK,
                                meta.block_table.shape[1])
    with torch.inference_mode():
        hidden = decoder(input_ids, positions,
                         ForwardContext(runner.backend, meta, runner.kv_caches))
        return runner.model.compute_logits(hidden)[0]


@pytest.mark.parametrize("fixture,prompt", [
    ("tiny_qwen3", PROMPTS[1]),
    ("tiny_qwen3_untied", PROMPTS[2]),  # 75 tokens: two key splits
    ("tiny_llama", PROMPTS[2]),  # llama3 rope scaling, no q/k norm
    ("tiny_llama_tied", [1, 2]),  # one key before the new one
])
def test_decode_step_matches_transformers(fixture, prompt, request):
    folder = request.getfixturevalue(fixture)
    runner, hf = make_runner(folder), load_hf(folder)
    assert unsupported_reason(runner.model, runner.kv_caches, 1) is None
    logits = decode_last_token(runner, prompt)
    torch.testing.assert_close(logits, hf_logits(hf, prompt)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("renormalize", [True, False])
def test_mixture_of_experts_decode_step_matches_transformers(tmp_path, renormalize):
    """Qwen3-MoE with every layer sparse: router, top-2 of 8 experts, in the same launch."""
    folder = write_tiny_moe(tmp_path, norm_topk_prob=renormalize, mlp_only_layers=())
    runner, hf = make_runner(folder), load_hf(folder)
    assert unsupported_reason(runner.model, runner.kv_caches, 1) is None
    logits = decode_last_token(runner, PROMPTS[1])
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[1])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_awq_decode_step_matches_transformers(tmp_path, family):
    """AWQ linear layers (the tests' packer, group 32) in the same launch: transformers'
    model holds the dequantized weights."""
    folder, hf = write_awq_model(tmp_path, family)
    runner = make_runner(folder)
    assert unsupported_reason(runner.model, runner.kv_caches, 1) is None
    logits = decode_last_token(runner, PROMPTS[2])
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[2])[-1], atol=1e-4, rtol=1e-4)


def test_unsupported_models_are_named(tiny_qwen3, tmp_path):
    runner = make_runner(tiny_qwen3)
    assert unsupported_reason(runner.model, runner.kv_caches, 2) == "tensor parallelism"
    moe = make_runner(write_tiny_moe(tmp_path))  # layer 1 keeps a dense MLP
    assert unsupported_reason(moe.model, moe.kv_caches, 1) == "dense layers among sparse ones"
    awq = make_runner(write_awq_model(tmp_path / "awq", "llama")[0])
    # what modules_to_not_convert leaves: one linear layer dense among AWQ ones
    awq.model.model.layers[1].mlp.down_proj.quant = None
    assert "modules_to_not_convert" in unsupported_reason(awq.model, awq.kv_caches, 1)


@pytest.mark.parametrize("steps", [1, 3])
def test_engine_greedy_tokens_match_transformers(tiny_qwen3, steps):
    """The engine with persistent_decode: each decode step of the one request runs the kernel
    (eagerly here; on a GPU the batch-1 graph holds it), one or several steps a launch."""
    from echo import LLM, SamplingParams

    prompt, new_tokens = PROMPTS[0], 6
    expected = hf_greedy_tokens(load_hf(tiny_qwen3), prompt, new_tokens)
    llm = LLM(str(tiny_qwen3), device="cpu", num_gpu_blocks_override=64, max_num_seqs=4,
              persistent_decode=True, num_scheduler_steps=steps)
    try:
        runner = llm.engine.executor.runner
        kernel = runner.persistent.kernel
        calls = []
        launch = kernel._launch
        kernel._launch = lambda *args: calls.append(args[4]) or launch(*args)
        greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        [out] = llm.generate([prompt], greedy, use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == expected
    # a launch a phase on the CPU: phase 0 once per decode step after the prefill's token
    assert calls.count(0) == new_tokens - 1


def test_a_barrier_that_gave_up_is_reported(tiny_qwen3):
    runner = make_runner(tiny_qwen3)
    decoder = PersistentDecoder(runner.model, runner.kv_caches, BLOCK, 8)
    decoder.raise_if_failed()  # a fresh flag
    decoder.kernel.sync[SYNC_ERROR.value] = 1  # what _grid_barrier sets when it gives up
    with pytest.raises(RuntimeError, match="not all resident at once"):
        decoder.raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 8])
def test_gpu_graphs_give_transformers_greedy_tokens(tiny_qwen3, steps):
    """The batch-1 decode graph captures the persistent launch (one step per launch, or
    eight with the sampling graphs over it); float32, so the tokens compare exactly."""
    prompt = PROMPTS[2]
    expected = hf_greedy_tokens(load_hf(tiny_qwen3), prompt, 32)
    assert echo_greedy_tokens(tiny_qwen3, [prompt], 32, device="cuda", dtype="float32",
                              persistent_decode=True, num_scheduler_steps=steps) == [expected]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_graphs_give_transformers_greedy_tokens_with_awq(tmp_path, family):
    folder, hf = write_awq_model(tmp_path, family)
    prompt = PROMPTS[2]
    expected = hf_greedy_tokens(hf, prompt, 32)
    assert echo_greedy_tokens(folder, [prompt], 32, device="cuda", dtype="float32",
                              persistent_decode=True) == [expected]


@pytest.mark.gpu
def test_gpu_graphs_give_transformers_greedy_tokens_with_experts(tmp_path):
    folder = write_tiny_moe(tmp_path, mlp_only_layers=())
    prompt = PROMPTS[1]
    expected = hf_greedy_tokens(load_hf(folder), prompt, 32)
    assert echo_greedy_tokens(folder, [prompt], 32, device="cuda", dtype="float32",
                              persistent_decode=True) == [expected]
