"""Offline throughput, nano-vllm's benchmark: 256 sequences, prompt and output lengths uniform in
[100, 1024], random token ids, ignore_eos, Qwen3-0.6B shapes with dummy weights.

    python tools/bench_offline.py [--model qwen3-8b] [--engine-process | --multiprocess]
        [--no-async] [--json F]

Prints output tokens per second (generated tokens / wall time). By default echo.LLM runs the
engine in this process; --engine-process runs echo.LLM(engine_process=True) (core and worker
processes); --multiprocess sends the same workload through the AsyncClient.
"""

import argparse
import asyncio
import json
import random
import time

from echo import LLM, AsyncClient, SamplingParams


def engine_args(args: argparse.Namespace) -> dict:
    return dict(load_format=args.load_format, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_dtype=args.kv_cache_dtype, async_scheduling=not args.no_async,
                tensor_parallel_size=args.tp)


def workload(args: argparse.Namespace, vocab: int):
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=rng.randint(args.min_len, args.max_len))
              for _ in range(args.num_seqs)]
    return prompts, params


def warm_up_workload(prompts: list[list[int]]):
    """A few of the prompts with short outputs, run before the clock starts: Triton compiles a
    kernel variant the first time a batch needs it (pure prefill, prefill chunks mixed with
    decodes, small decode batches), which on a fresh machine takes seconds of the timed run."""
    few = prompts[:32]
    return few, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16)] * len(few)


def run_llm(args: argparse.Namespace) -> tuple[int, float, dict]:
    llm = LLM(args.model, engine_process=args.engine_process, **engine_args(args))
    prompts, params = workload(args, llm.config.model.arch.vocab_size)
    llm.generate(*warm_up_workload(prompts), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.shutdown()
    return generated, elapsed, {"num_kv_blocks": llm.num_gpu_blocks,
                                "prompt_tokens": sum(map(len, prompts))}


async def run_multiprocess(args: argparse.Namespace) -> tuple[int, float, dict]:
    async with AsyncClient(args.model, **engine_args(args)) as client:
        prompts, params = workload(args, client.config.model.arch.vocab_size)

        async def one(prompt, sp) -> int:
            last = None
            async for out in client.generate(prompt, sp):
                last = out
            return len(last.outputs[0].token_ids)

        await asyncio.gather(*(one(p, sp) for p, sp in zip(*warm_up_workload(prompts))))
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
        elapsed = time.perf_counter() - start
        return sum(counts), elapsed, {"num_kv_blocks": client.engine_info["num_gpu_blocks"],
                                      "prompt_tokens": sum(map(len, prompts))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--engine-process", action="store_true",
                      help="echo.LLM with the engine in its own processes")
    mode.add_argument("--multiprocess", action="store_true",
                      help="run through AsyncClient (core and worker processes)")
    parser.add_argument("--no-async", action="store_true", help="async_scheduling off")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()

    if args.multiprocess:
        generated, elapsed, info = asyncio.run(run_multiprocess(args))
    else:
        generated, elapsed, info = run_llm(args)
    mode = ("multi-process" if args.multiprocess
            else "LLM, engine process" if args.engine_process else "in-process")
    result = {"model": args.model, "mode": mode, "num_seqs": args.num_seqs,
              "output_tokens": generated, "seconds": round(elapsed, 3),
              "output_tok_per_s": round(generated / elapsed, 1),
              "enforce_eager": args.enforce_eager, "async_scheduling": not args.no_async,
              "kv_cache_dtype": args.kv_cache_dtype, "tp": args.tp, **info}
    print(f"{args.model} ({mode}): {generated} output tokens in {elapsed:.2f} s = "
          f"{generated / elapsed:,.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":  # the engine's processes are spawned: keep this guard
    main()
