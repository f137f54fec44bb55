"""Does loading KV from the host tier slow the requests that are decoding meanwhile?

    python tools/bench_kv_load_decode.py --model qwen3-8b [--decoders 32] [--histories 4] \\
        [--history-len 32768] [--json out.json]

1. --histories prompts of --history-len random tokens run once (one output token each): their
   blocks are written through to the host tier as they finish.
2. Fillers (as many tokens as the GPU pool holds, and more) push them out of the GPU prefix cache.
3. --decoders requests decode; once every one of them has decoded --settle-steps tokens, the
   histories come back with --suffix-len new tokens each: their prefixes load from the host tier
   (one load each, all started in one step) while the decoders go on. Each history is admitted
   as its own load lands; a few long ones (4 x 32K tokens, 8,192 Qwen3-8B blocks, 19 GB, as
   32 x 4K moved before 2026-12-05) leave the decoders alone between admissions for ~100 ms at
   a time, where 32 short ones would be admitted every ~11 ms.
Each engine step is timed where the core takes its output (EngineCore.step_overlapped, two steps
in flight, in this process). Of the steps in which the decoders alone decode (one token each,
nothing else scheduled, nor in the step launched after them: each history is admitted as its own
load lands, and an admission's launch would count in the period before it), those that end
while a load is in flight are compared with the others:
the decoders' tokens per second is their count over the median step period (a mean lets one
stall anywhere in the run decide; the maxima are reported beside). Also reported: the bytes the
host tier moved over its copy seconds (CUDA events on its side stream, each chunk's copies), and
over the wall time loads were in flight, against pinned host <-> device copies of 1 GiB timed in
the same process (CUDA only).
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo import LLM, SamplingParams  # noqa: E402
from echo.config import EngineConfig  # noqa: E402
from echo.engine.messages import EngineCoreRequest  # noqa: E402
from echo.worker.kv_cache import kv_cache_spec  # noqa: E402


def pinned_copy_gb_per_s(size: int = 2**30, repeats: int = 5) -> dict | None:
    """Best of `repeats` 1 GiB copies each way between pinned host memory and the GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    result = {}
    for name, dst, src in (("h2d", device, host), ("d2h", host, device)):
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        result[name] = size / best / 1e9
    del host, device
    torch.cuda.empty_cache()
    return result


class StepClock:
    """Wraps the scheduler's update_from_output: when each step's output reached the core, how
    many requests and tokens it scheduled, and whether a host-tier load was in flight then."""

    def __init__(self, scheduler):
        self.records: list[tuple[float, int, int, bool]] = []
        update = scheduler.update_from_output

        def timed(scheduler_output, runner_output):
            self.records.append((time.perf_counter(), len(scheduler_output.num_scheduled_tokens),
                                 scheduler_output.total_num_scheduled_tokens,
                                 scheduler.kv.loads_in_flight))
            return update(scheduler_output, runner_output)

        scheduler.update_from_output = timed

    def decode_periods(self, num_decoders: int) -> dict[bool, list[float]]:
        """Step periods (s) between two steps in a row that each decoded every decoder and
        nothing else, keyed by whether a load was in flight at the second. The step after
        them must be one too: with two steps in flight the core launches it before it takes
        the second's output, so a period ending before an admission holds the admission's
        launch (a mixed step, launched eagerly), which is not the decoders' cost of loads."""
        periods: dict[bool, list[float]] = {False: [], True: []}
        records = self.records
        for (t0, n0, k0, _), (t1, n1, k1, loading), (_, n2, k2, _) in zip(
                records, records[1:], records[2:]):
            if n0 == k0 == n1 == k1 == n2 == k2 == num_decoders:
                periods[loading].append(t1 - t0)
        return periods

    def loading_seconds(self) -> float:
        """From the first step that saw a load in flight to the last."""
        times = [t for t, _, _, loading in self.records if loading]
        return times[-1] - times[0] if times else 0.0


def spread(periods: list[float]) -> dict | None:
    """p50 and max of step periods, in ms."""
    if not periods:
        return None
    return {"p50": 1e3 * statistics.median(periods), "max": 1e3 * max(periods)}


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    block, spare = 16, 64

    def blocks(num_tokens: int) -> int:
        return -(-num_tokens // block)

    history_blocks = args.histories * blocks(args.history_len + args.suffix_len + 1)
    decoder_len = args.decoder_prompt_len + args.settle_steps + args.max_decode_steps
    decoder_blocks = args.decoders * blocks(decoder_len)
    gpu_blocks = args.num_gpu_blocks_override or history_blocks + decoder_blocks + spare
    # fillers of a history's length, more tokens than the pool holds
    filler_count = -(-(gpu_blocks + spare) * block // args.history_len)
    engine_args = dict(load_format=args.load_format, device=args.device, block_size=block,
                       max_model_len=max(args.history_len + args.suffix_len + 8,
                                         decoder_len + 8),
                       max_num_seqs=args.decoders + args.histories,
                       num_gpu_blocks_override=gpu_blocks)
    offload = args.kv_offloading_size
    if offload is None:  # the histories and the fillers after them, with a tenth to spare
        spec = kv_cache_spec(EngineConfig.create(args.model, **engine_args))
        host_blocks = history_blocks + filler_count * blocks(args.history_len + 1)
        offload = 1.1 * host_blocks * spec.bytes_per_block() / 2**30
    pinned = pinned_copy_gb_per_s() if args.device != "cpu" else None
    llm = LLM(args.model, kv_offloading_size=offload, **engine_args)
    try:
        core = llm.engine
        vocab = llm.config.model.arch.vocab_size

        def tokens(n: int) -> list[int]:
            return [rng.randrange(100, vocab - 1) for _ in range(n)]

        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        histories = [tokens(args.history_len) for _ in range(args.histories)]
        llm.generate(histories, one, use_tqdm=False)
        llm.generate([tokens(args.history_len) for _ in range(filler_count)], one,
                     use_tqdm=False)
        before = llm.stats()
        clock = StepClock(core.scheduler)
        decode = SamplingParams(temperature=0, ignore_eos=True,
                                max_tokens=args.settle_steps + args.max_decode_steps)
        decoded: dict[str, int] = {}
        for i in range(args.decoders):
            core.add_request(EngineCoreRequest(f"d{i}", tokens(args.decoder_prompt_len),
                                               decode, time.time()))
            decoded[f"d{i}"] = 0
        sent_at = None  # the decoders' progress when the histories came back
        pending: set[str] = set()
        while True:
            outputs = core.step_overlapped()
            for out in outputs.outputs if outputs is not None else ():
                if out.request_id in decoded:
                    decoded[out.request_id] += len(out.new_token_ids)
                elif out.finish_reason is not None:
                    pending.discard(out.request_id)
            progress = min(decoded.values())
            if sent_at is None and progress >= args.settle_steps:
                sent_at = progress
                for i, history in enumerate(histories):
                    core.add_request(EngineCoreRequest(
                        f"h{i}", history + tokens(args.suffix_len), one, time.time()))
                    pending.add(f"h{i}")
            elif sent_at is not None and not pending and progress >= sent_at + args.after_steps:
                break
            if progress >= args.settle_steps + args.max_decode_steps:
                raise RuntimeError("the histories did not finish within --max-decode-steps")
        core.abort_requests(list(decoded))
        while core.has_work():
            core.step_overlapped()
        after = llm.stats()
    finally:
        llm.shutdown()
    periods = clock.decode_periods(args.decoders)
    rate = {loading: args.decoders / statistics.median(p) if p else None
            for loading, p in periods.items()}
    moved = (after.kv_loaded_bytes - before.kv_loaded_bytes
             + after.kv_stored_bytes - before.kv_stored_bytes)
    seconds = after.kv_transfer_seconds - before.kv_transfer_seconds
    loading_s = clock.loading_seconds()
    return {
        "model": args.model, "decoders": args.decoders, "histories": args.histories,
        "history_len": args.history_len, "num_gpu_blocks": gpu_blocks,
        "kv_offloading_size_gib": offload,
        "decode_steps_without_loads": len(periods[False]),
        "decode_steps_with_loads": len(periods[True]),
        "decode_tok_per_s_without_loads": rate[False],
        "decode_tok_per_s_with_loads": rate[True],
        "decode_ratio_with_loads": (rate[True] / rate[False]
                                    if rate[True] and rate[False] else None),
        # a stall (the host blocked issuing copies) shows in the maxima, a slower step in p50
        "step_ms_without_loads": spread(periods[False]),
        "step_ms_with_loads": spread(periods[True]),
        "loaded_blocks": after.kv_loaded_blocks - before.kv_loaded_blocks,
        "loaded_bytes": after.kv_loaded_bytes - before.kv_loaded_bytes,
        "stored_bytes": after.kv_stored_bytes - before.kv_stored_bytes,
        "transfer_seconds": seconds,
        "transfer_gb_per_s": moved / seconds / 1e9 if seconds > 0 else None,
        "loads_in_flight_s": loading_s,
        "loaded_gb_per_s_wall": ((after.kv_loaded_bytes - before.kv_loaded_bytes) / loading_s
                                 / 1e9 if loading_s > 0 else None),
        "pinned_copy_gb_per_s": pinned,
    }


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--decoders", type=int, default=32)
    parser.add_argument("--decoder-prompt-len", type=int, default=128)
    parser.add_argument("--histories", type=int, default=4)
    parser.add_argument("--history-len", type=int, default=32768)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--settle-steps", type=int, default=20)
    parser.add_argument("--after-steps", type=int, default=20)
    parser.add_argument("--max-decode-steps", type=int, default=500)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="default: the histories and decoders, and 64 blocks more")
    parser.add_argument("--kv-offloading-size", type=float, default=None,
                        help="GiB (default: what the histories and fillers take, +10%%)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = arguments().parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
