"""echo's Llama and Qwen3 compute what transformers computes (float32, CPU, torch backend)."""

import pytest
import torch

from echo.config import EngineConfig
from echo.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from echo.sampling_params import SamplingParams
from echo.worker.model_runner import ModelRunner
from tests.helpers import VOCAB, load_hf

BLOCK = 16


def make_runner(folder) -> ModelRunner:
    config = EngineConfig.create(str(folder), device="cpu", dtype="float32", block_size=BLOCK,
                                 num_gpu_blocks_override=64, max_num_seqs=8)
    runner = ModelRunner(config)
    runner.init_kv_cache(64)
    return runner


def prefill_output(prompts: list[list[int]], chunk: int | None = None, step_id: int = 0):
    """One step that schedules every prompt (or its first `chunk` tokens), blocks laid out
    request after request."""
    new, counts, next_block = [], {}, 0
    for i, prompt in enumerate(prompts):
        num_blocks = -(-len(prompt) // BLOCK)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        new.append(NewRequestData(f"r{i}", prompt, SamplingParams(temperature=0), blocks, 0))
        counts[f"r{i}"] = min(len(prompt), chunk or len(prompt))
    return SchedulerOutput(step_id=step_id, scheduled_new_reqs=new, num_scheduled_tokens=counts,
                           total_num_scheduled_tokens=sum(counts.values()))


def echo_logits(runner: ModelRunner, out: SchedulerOutput) -> torch.Tensor:
    runner.input_batch.update(out, VOCAB)
    inp = runner.input_batch.prepare(out)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.forward(inp))


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 40)), [1] + list(range(90, 127)) * 2, [1, 2]]


def assert_prefill_logits_match(logits: torch.Tensor, hf, prompts=PROMPTS,
                                tolerance: float = 1e-4) -> None:
    """The logits of one step over prompts (prefill_output: prompt after prompt) against
    transformers' for each prompt alone."""
    start = 0
    for prompt in prompts:
        torch.testing.assert_close(logits[start:start + len(prompt)].cpu(), hf_logits(hf, prompt),
                                   atol=tolerance, rtol=tolerance)
        start += len(prompt)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama_tied", "tiny_qwen3",
                                     "tiny_qwen3_untied"])
def test_prefill_logits_match_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    runner, hf = make_runner(folder), load_hf(folder)
    assert_prefill_logits_match(echo_logits(runner, prefill_output(PROMPTS)), hf)


def test_chunked_prefill_over_cached_prefix_matches_transformers(tiny_qwen3):
    """A prompt computed in two chunks: the second attends to KV stored by the first."""
    runner, hf = make_runner(tiny_qwen3), load_hf(tiny_qwen3)
    prompt = PROMPTS[2]
    echo_logits(runner, prefill_output([prompt], chunk=20))
    rest = len(prompt) - 20
    second = SchedulerOutput(
        step_id=1, scheduled_cached_reqs=CachedRequestData(["r0"], [[]], [20]),
        num_scheduled_tokens={"r0": rest}, total_num_scheduled_tokens=rest)
    logits = echo_logits(runner, second)
    torch.testing.assert_close(logits, hf_logits(hf, prompt)[20:], atol=1e-4, rtol=1e-4)
