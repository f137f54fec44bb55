"""Decode latency of a fixed batch: time per output token once the prompt is in the cache.

    python tools/bench_latency.py [--model llama-3.1-8b] [--batch-size 1] [--input-len 256]
        [--output-len 256] [--iters 3] [--json F]

Each iteration generates the batch twice with identical prompts: once for one token (prefill
alone) and once for --output-len tokens; the difference divided by the extra tokens is the time
per decode step, free of start-up, JIT compilation (a warm-up of the same shapes runs first)
and prefill. Prefix caching is off so every run prefills. Prints the median over iterations.
"""

import argparse
import json
import random
import statistics
import time

from echo import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.output_len < 2:
        parser.error("--output-len must be at least 2")

    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              max_num_seqs=max(args.batch_size, 1), enable_prefix_caching=False,
              kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tp)
    rng = random.Random(0)
    vocab = llm.config.model.arch.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.batch_size)]

    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(args.output_len)  # warm-up: every kernel shape of the measured runs compiled here
    prefill_s, per_token_s = [], []
    for _ in range(args.iters):
        prefill = run(1)
        full = run(args.output_len)
        prefill_s.append(prefill)
        per_token_s.append((full - prefill) / (args.output_len - 1))
    ms = statistics.median(per_token_s) * 1e3
    result = {"model": args.model, "batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "kv_cache_dtype": args.kv_cache_dtype,
              "enforce_eager": args.enforce_eager, "tp": args.tp,
              "prefill_ms": round(statistics.median(prefill_s) * 1e3, 2),
              "decode_ms_per_step": round(ms, 3),
              "decode_tok_per_s": round(args.batch_size * 1e3 / ms, 1)}
    print(f"{args.model} B={args.batch_size} in={args.input_len} out={args.output_len}: "
          f"prefill {result['prefill_ms']} ms, decode {ms:.3f} ms/step "
          f"({result['decode_tok_per_s']:,} tok/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":  # the engine's processes may be spawned: keep this guard
    main()
