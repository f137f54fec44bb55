"""Microseconds per scheduler step (schedule() + update_from_output()) in steady decode.

For each batch size, N requests are admitted and prefilled, then every step decodes one token
for each of them; the timed part is the scheduler's own work, not the fake runner's. With
prefix caching on, the prompts share a system prompt and every filled block is hashed and
registered, which is the caching cost a decode step pays.

    python tools/bench_scheduler.py [--steps 300] [--sizes 64 256 1024]
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout too

from echo.config import CacheConfig, SchedulerConfig  # noqa: E402
from echo.core.request import Request  # noqa: E402
from echo.core.scheduler import Scheduler  # noqa: E402
from echo.core.step_results import ModelRunnerOutput  # noqa: E402
from echo.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
SYSTEM_PROMPT = list(range(1, 65))  # 64 tokens shared by every request
PROMPT_LEN = 128


def one_token_each(sched: Scheduler, so) -> ModelRunnerOutput:
    """What the workers would return: a token for each request whose step reaches its end."""
    req_ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        request = sched.requests[rid]
        req_ids.append(rid)
        # synchronous stepping: a placeholder now means this step samples
        done = request.num_output_placeholders > 0
        sampled.append([(request.num_tokens * 31) % 50_000 + 1] if done else [])
    return ModelRunnerOutput(so.step_id, req_ids, sampled)


def bench(num_requests: int, prefix_caching: bool, steps: int) -> dict:
    max_len = PROMPT_LEN + steps + 64
    num_blocks = num_requests * (-(-max_len // BLOCK_SIZE)) + 16
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_requests,
                        max_num_batched_tokens=max(8192, num_requests), max_model_len=4096),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        num_blocks)
    params = SamplingParams(max_tokens=steps + 32, ignore_eos=True)
    for i in range(num_requests):
        own = [100_000 + i * PROMPT_LEN + j for j in range(PROMPT_LEN - len(SYSTEM_PROMPT))]
        sched.add_request(Request(f"req-{i}", SYSTEM_PROMPT + own, params, eos_token_ids=(0,)))
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):  # prefill
        so = sched.schedule()
        sched.update_from_output(so, one_token_each(sched, so))

    sched_us, update_us = [], []
    gc.collect()
    for _ in range(steps):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        runner_output = one_token_each(sched, so)
        t2 = time.perf_counter()
        sched.update_from_output(so, runner_output)
        t3 = time.perf_counter()
        assert len(so.num_scheduled_tokens) == num_requests
        sched_us.append((t1 - t0) * 1e6)
        update_us.append((t3 - t2) * 1e6)
    total = [s + u for s, u in zip(sched_us, update_us, strict=True)]
    return {
        "schedule": statistics.mean(sched_us),
        "update": statistics.mean(update_us),
        "mean": statistics.mean(total),
        "p50": statistics.median(total),
        "p99": sorted(total)[int(len(total) * 0.99) - 1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args()
    print(f"steady decode, {args.steps} steps, block_size {BLOCK_SIZE}, prompt {PROMPT_LEN}")
    print(f"{'running':>8} {'prefix cache':>12} {'schedule us':>12} {'update us':>10} "
          f"{'step us':>9} {'p50':>8} {'p99':>8} {'us/request':>11}")
    for n in args.sizes:
        for caching in (False, True):
            r = bench(n, caching, args.steps)
            print(f"{n:>8} {'on' if caching else 'off':>12} {r['schedule']:>12.0f} "
                  f"{r['update']:>10.0f} {r['mean']:>9.0f} {r['p50']:>8.0f} {r['p99']:>8.0f} "
                  f"{r['mean'] / n:>11.2f}")


if __name__ == "__main__":
    main()
