"""Multi-turn chat against the KV cache's tiers: does a later turn reuse its history?

    python tools/bench_multiturn.py --model qwen3-8b --conversations 32 --turns 6 \\
        --num-gpu-blocks-override 4000 [--kv-offloading-size 64] --json out.json --plot out.png

N conversations share a system prompt and grow: each turn sends the whole history (system
prompt, every earlier user message and answer) plus a new user message, as a chat client
does. Turns are interleaved (turn t of every conversation, at most --max-concurrency at once,
then turn t + 1), so with a GPU KV cache smaller than the working set (num_gpu_blocks_override)
a conversation's history is evicted before its next turn: without a host tier it is
recomputed, with one (--kv-offloading-size, GiB) it is loaded. Prompts are random token ids
and answers have a fixed length (ignore_eos), so dummy weights do; nothing is downloaded.

Reports, per turn, TTFT p50/p99 (AsyncClient: the engine in its own processes, as served) and
the p50 of the time from a request's submission to its first step (a load's wait
included), the p50s over every request of the later turns (the second half: one turn's p50
over N requests moves between neighbouring turns), and for the run the prefix-cache hit rate
of each tier (GPU hits include loaded blocks), the mean wait of a loading request for its load,
and the output throughput. --json writes it all; --plot draws TTFT p50/p99 by turn;
--against BASELINE.json (a run without the tier) prints how many times lower the TTFT p50s
are, by turn and pooled.
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo import SamplingParams  # noqa: E402
from echo.engine.async_client import AsyncClient  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_turn(client: AsyncClient, prompt: list[int], params: SamplingParams,
                   gate: asyncio.Semaphore) -> tuple[float, float, list[int]]:
    """(TTFT in seconds, the queue time in seconds, the answer's token ids). The queue time
    runs from the client's submission to the request's first scheduled step in the core, so it
    holds a load's wait for its history; the rest of the TTFT is its prefill and the way
    back."""
    async with gate:
        start = time.perf_counter()
        ttft, queue, tokens = None, None, []
        async for out in client.generate(prompt, params):
            if ttft is None and out.outputs[0].delta_token_ids:
                ttft = time.perf_counter() - start
            if queue is None:
                queue = out.queue_time
            tokens = out.outputs[0].token_ids
        return ttft, queue, tokens


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    engine_args = {"load_format": args.load_format, "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs, "device": args.device,
                   "num_gpu_blocks_override": args.num_gpu_blocks_override,
                   "kv_offloading_size": args.kv_offloading_size,
                   "kv_offloading_policy": args.kv_offloading_policy}
    engine_args = {k: v for k, v in engine_args.items() if v is not None}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    async with AsyncClient(args.model, **engine_args) as client:
        vocab = client.config.model.arch.vocab_size

        def tokens(n: int) -> list[int]:
            return [rng.randrange(100, vocab - 1) for _ in range(n)]

        system = tokens(args.system_len)
        histories = [list(system) for _ in range(args.conversations)]
        gate = asyncio.Semaphore(args.max_concurrency)
        turns, start, generated, later, later_queues = [], time.perf_counter(), 0, [], []
        for turn in range(args.turns):
            prompts = [h + tokens(args.user_len) for h in histories]
            results = await asyncio.gather(*(one_turn(client, p, params, gate)
                                             for p in prompts))
            ttfts = [ttft for ttft, _, _ in results]
            queues = [queue for _, queue, _ in results]
            if turn >= args.turns // 2:
                later += ttfts
                later_queues += queues
            histories = [p + answer for p, (_, _, answer) in zip(prompts, results)]
            generated += sum(len(answer) for _, _, answer in results)
            turns.append({"turn": turn, "prompt_len_mean": statistics.mean(map(len, prompts)),
                          "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5),
                          "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
                          "queue_p50_ms": 1e3 * percentile(queues, 0.5)})
            print(f"turn {turn}: prompt ~{turns[-1]['prompt_len_mean']:.0f} tokens, TTFT p50 "
                  f"{turns[-1]['ttft_p50_ms']:.1f} ms, p99 {turns[-1]['ttft_p99_ms']:.1f} ms, "
                  f"queued p50 {turns[-1]['queue_p50_ms']:.1f} ms", flush=True)
        elapsed = time.perf_counter() - start
        stats = await client.stats()
    return {
        "model": args.model, "conversations": args.conversations, "turns": turns,
        "later_turns_from": args.turns // 2,
        "later_ttft_p50_ms": 1e3 * percentile(later, 0.5) if later else None,
        "later_queue_p50_ms": 1e3 * percentile(later_queues, 0.5) if later else None,
        "kv_offloading_size": args.kv_offloading_size,
        "kv_offloading_policy": args.kv_offloading_policy,
        "num_gpu_blocks": client.engine_info.get("num_gpu_blocks"),
        "gpu_hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
        "host_hit_rate": stats.kv_host_hits / max(1, stats.kv_host_queries),
        "stored_blocks": stats.kv_stored_blocks, "loaded_blocks": stats.kv_loaded_blocks,
        "loads": stats.kv_loads,  # requests that loaded: loaded_blocks / loads a load's size
        # what a load added to a loading request's first token, on average
        "load_wait_ms_mean": 1e3 * stats.kv_load_wait_seconds / max(1, stats.kv_loads),
        "loads_joined": stats.kv_loads_joined,  # ran in the step that loaded them: no wait
        "output_tok_per_s": generated / elapsed, "elapsed_s": elapsed,
    }


def ttft_ratios(baseline: dict, result: dict) -> dict:
    """How many times lower result's TTFT p50s are than baseline's: by turn, and over the later
    turns' requests pooled (both runs with the same turns)."""
    if [t["turn"] for t in baseline["turns"]] != [t["turn"] for t in result["turns"]]:
        raise ValueError("--against: the baseline ran other turns")
    return {"by_turn": [b["ttft_p50_ms"] / r["ttft_p50_ms"]
                        for b, r in zip(baseline["turns"], result["turns"])],
            "later": baseline["later_ttft_p50_ms"] / result["later_ttft_p50_ms"]}


def plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    turns = [t["turn"] for t in result["turns"]]
    for key, label in (("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99")):
        ax.plot(turns, [t[key] for t in result["turns"]], marker="o", label=label)
    offload = result["kv_offloading_size"]
    ax.set_title(f"{result['model']}: TTFT by turn, host tier "
                 f"{f'{offload} GiB' if offload else 'off'}")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The conversations and how they arrive (tools/dev/sim_kv_loads.py models the same)."""
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--user-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=64)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default=None)
    add_workload_args(parser)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--kv-offloading-size", type=float, default=None,
                        help="GiB of host tier; none: off")
    parser.add_argument("--kv-offloading-policy", default=None,
                        choices=("write_through", "write_back"),
                        help="when blocks go to the host tier (engine default: write_through)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--against", type=Path, help="a baseline run's --json")
    args = parser.parse_args(argv)
    baseline = json.loads(args.against.read_text()) if args.against else None
    result = asyncio.run(run(args))
    if baseline is not None:
        result["ttft_p50_lower_than_baseline"] = ratios = ttft_ratios(baseline, result)
        print("TTFT p50 times lower than the baseline, by turn: "
              + " ".join(f"{r:.2f}" for r in ratios["by_turn"])
              + f"; later turns' requests pooled: {ratios['later']:.2f}", flush=True)
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("turns", "ttft_p50_lower_than_baseline")}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
