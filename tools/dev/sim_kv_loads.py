"""bench_multiturn's workload through the real scheduler and a fake runner, on the CPU, with a
model of the device's time: how many host-tier loads are joined, what the copies queued before
a joined load stall, and the later turns' TTFT that follows, for join limits side by side.

    python tools/dev/sim_kv_loads.py --limits 0,64,128,256,512

A model, not a measurement: every step takes STEP_MS + PREFILL_MS a prefill token + DECODE_MS a
decoding request (defaults fitted to Qwen3-8B's runs on one H100, docs/benchmarks.md KV offload:
the run without the tier reads 226-237 ms at turns 3-5 there, 200-265 measured); the host tier's
copies queue on one side stream at COPY_GBPS, ordered ones after the step before theirs ends,
unordered ones from the start of the step in flight; a step waits for its joined loads
(before_step) and whatever is queued before them. A transfer is reported with the output of the
step that carries it. The scheduler, the KV cache manager and its join rule are the engine's
own (tests/core/fake_runner.py stands in for the workers), so the loads and joins it counts are
the engine's: 118 loads of 8,429 blocks here, as on the H100.
"""

import argparse
import os
import random
import statistics
import sys
from collections import deque
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_multiturn import add_workload_args  # noqa: E402

from echo.core.request import Request  # noqa: E402
from echo.sampling_params import SamplingParams  # noqa: E402
from tests.core.scheduler_helpers import make_runner, make_scheduler  # noqa: E402


class DeviceClock:
    """The model of the device's time: steps back to back, the side stream's copies beside."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ms_per_block = args.block_mb / args.copy_gbps  # MB / (GB/s) = ms
        self.now = 0.0
        self.stream_free = 0.0
        self.in_flight = (0.0, 0.0)  # the step before: its start and its end
        self.stall_ms = 0.0

    def run(self, so) -> float:
        """Time one step's plan; the time its output is ready."""
        start = self.now
        for transfer in so.kv_transfers:
            blocks = len(transfer.stores) + len(transfer.loads)
            ready = self.in_flight[1] if transfer.ordered else self.in_flight[0]
            self.stream_free = max(self.stream_free, ready) + self.ms_per_block * blocks
            if transfer.before_step and self.stream_free > start:
                self.stall_ms += self.stream_free - start
                start = self.stream_free
        tokens = so.num_scheduled_tokens.values()
        prefill = sum(n for n in tokens if n > 1)
        decode = sum(1 for n in tokens if n == 1)
        self.now = start + (self.args.step_ms + self.args.prefill_ms * prefill
                            + self.args.decode_ms * decode)
        self.in_flight = (start, self.now)
        return self.now


def simulate(args: argparse.Namespace, host_blocks: int, early: bool, limit: int) -> dict:
    rng = random.Random(args.seed)
    switches = {"ECHO_KV_EARLY_LOADS": "1" if early else "0",
                "ECHO_KV_JOINED_LOAD_BLOCKS": str(limit)}
    with mock.patch.dict(os.environ, switches):  # the scheduler reads them as it is made
        sched = make_scheduler(num_blocks=args.gpu_blocks, block_size=args.block_size,
                               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
                               max_model_len=8192, host_tier={} if host_blocks else None,
                               num_host_blocks=host_blocks)
    runner = make_runner(sched, vocab_size=32000, check_kv=False)
    clock = DeviceClock(args)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 31999) for _ in range(n)]

    system = tokens(args.system_len)
    histories = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    by_turn, later, pending = [], [], deque()
    for turn in range(args.turns):
        prompts = [h + tokens(args.user_len) for h in histories]
        queue, active, arrived, ttft = deque(range(args.conversations)), {}, {}, {}
        answers: dict[str, list[int]] = {}
        while queue or active:
            while queue and len(active) < args.max_concurrency:  # bench_multiturn's gate
                i = queue.popleft()
                rid = f"t{turn}c{i}"
                sched.add_request(Request(rid, prompts[i], params, eos_token_ids=(0,)))
                active[rid], arrived[rid], answers[rid] = i, clock.now, []
            if sched.has_unfinished_requests():
                so = sched.schedule()
                pending.append((so, runner.execute(so), clock.run(so)))
            if len(pending) >= 2 or not sched.has_unfinished_requests():  # two steps in flight
                so, out, ready = pending.popleft()
                for o in sched.update_from_output(so, out):
                    if o.request_id not in active:
                        continue
                    if o.new_token_ids and o.request_id not in ttft:
                        ttft[o.request_id] = ready - arrived[o.request_id]
                    answers[o.request_id] += o.new_token_ids
                    if o.finish_reason is not None:
                        i = active.pop(o.request_id)
                        histories[i] = prompts[i] + answers[o.request_id]
        by_turn.append(statistics.median(ttft.values()))
        if turn >= args.turns // 2:
            later += ttft.values()
    kv = sched.kv
    return {"by_turn": by_turn, "later": statistics.median(later), "loads": kv.loads_done,
            "joined": kv.loads_joined, "loaded_blocks": kv.loaded_blocks,
            "stall_ms": clock.stall_ms}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits", default="128,256", help="join limits, blocks")
    add_workload_args(parser)
    parser.add_argument("--gpu-blocks", type=int, default=1500)
    parser.add_argument("--host-blocks", type=int, default=6900, help="16 GiB of Qwen3-8B's")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--block-mb", type=float, default=2.36, help="Qwen3-8B's, bf16")
    parser.add_argument("--copy-gbps", type=float, default=51.5)
    parser.add_argument("--step-ms", type=float, default=7.0)
    parser.add_argument("--prefill-ms", type=float, default=0.03)
    parser.add_argument("--decode-ms", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    def show(name: str, run: dict, base: dict) -> None:
        print(f"{name:<26} TTFT p50 by turn {' '.join(f'{t:.0f}' for t in run['by_turn'])} ms;"
              f" later {run['later']:.0f} ms, {base['later'] / run['later']:.2f}x lower; loads"
              f" {run['loads']} ({run['loaded_blocks']} blocks), joined {run['joined']}, "
              f"stalled {run['stall_ms']:.0f} ms", flush=True)

    base = simulate(args, 0, False, 0)
    show("no tier", base, base)
    show("tier, early loads off", simulate(args, args.host_blocks, False, 0), base)
    for limit in map(int, args.limits.split(",")):
        show(f"early loads, limit {limit}", simulate(args, args.host_blocks, True, limit), base)


if __name__ == "__main__":
    main()
