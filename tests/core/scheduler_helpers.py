"""Shared scheduler-test helpers: schedulers, requests and a scripted fake runner."""

import zlib
from collections import deque

from echo.config import CacheConfig, SchedulerConfig
from echo.core.request import Request
from echo.core.scheduler import Scheduler
from echo.core.step_results import EngineCoreOutput
from echo.sampling_params import SamplingParams
from tests.core.fake_runner import FakeModelRunner

EOS = 0


def make_scheduler(num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, max_model_len: int = 512,
                   prefix_caching: bool = True, num_scheduler_steps: int = 1,
                   host_tier: dict | None = None, **kwargs) -> Scheduler:
    """host_tier: the CacheConfig fields of a host tier (kv_offloading_policy,
    preemption_mode); its size in blocks is the num_host_blocks keyword."""
    cache = {"kv_offloading_size": 1.0, **host_tier} if host_tier is not None else {}
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, num_scheduler_steps=num_scheduler_steps),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching, **cache),
        num_blocks, **kwargs)


def make_request(rid: str, prompt: int | list[int], max_tokens: int | None = 16,
                 **params) -> Request:
    if isinstance(prompt, int):  # tokens of this request's own (no shared prefix by chance)
        base = 1000 * (zlib.crc32(rid.encode()) % 1_000_000 + 1)
        prompt = [base + i for i in range(prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(EOS,))


def make_runner(sched: Scheduler, **kwargs) -> FakeModelRunner:
    return FakeModelRunner(sched.block_size, sched.kv.num_blocks, **kwargs)


def scripted(scripts: dict[str, list[int]], prompt_lens: dict[str, int]):
    """A next_token function that emits each request's script, then token 7 forever."""
    def next_token(rid: str, token_ids: list[int]) -> int:
        script = scripts.get(rid, [])
        n = len(token_ids) - prompt_lens[rid]
        return script[n] if n < len(script) else 7
    return next_token


def run(sched: Scheduler, runner: FakeModelRunner, in_flight: int = 1,
        max_steps: int = 10_000) -> dict[str, EngineCoreOutput]:
    """Drive the scheduler like the engine does, with `in_flight` steps outstanding: step N+1 is
    scheduled (and launched) before step N's output is processed. Returns each request's
    outputs merged into one EngineCoreOutput."""
    merged: dict[str, EngineCoreOutput] = {}
    pending: deque = deque()
    for _ in range(max_steps):
        if sched.has_unfinished_requests():
            so = sched.schedule()
            pending.append((so, runner.execute(so)))
        if not pending:
            return merged
        if len(pending) >= in_flight or not sched.has_unfinished_requests():
            for out in sched.update_from_output(*pending.popleft()):
                merge(merged, out)
    raise AssertionError(f"not done after {max_steps} steps")


def merge(merged: dict[str, EngineCoreOutput], out: EngineCoreOutput) -> None:
    prev = merged.get(out.request_id)
    if prev is None:
        merged[out.request_id] = EngineCoreOutput(out.request_id, list(out.new_token_ids),
                                                  list(out.new_logprobs), out.finish_reason,
                                                  out.stop_reason, out.num_cached_tokens)
    else:
        assert prev.finish_reason is None, f"{out.request_id}: output after finishing"
        prev.new_token_ids.extend(out.new_token_ids)
        prev.new_logprobs.extend(out.new_logprobs)
        prev.finish_reason, prev.stop_reason = out.finish_reason, out.stop_reason


def step(sched: Scheduler, runner: FakeModelRunner):
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))
