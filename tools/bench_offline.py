"""Offline throughput, nano-vllm's benchmark: 256 sequences, prompt and output lengths uniform in
[100, 1024], random token ids, ignore_eos, Qwen3-0.6B shapes with dummy weights.

    python tools/bench_offline.py [--model qwen3-8b] [--num-seqs 256] [--json out.json]

Prints output tokens per second (generated tokens / wall time of generate()).
"""

import argparse
import json
import random
import time

from echo import LLM, SamplingParams


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
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()

    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_dtype=args.kv_cache_dtype)
    rng = random.Random(args.seed)
    vocab = llm.config.model.arch.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=rng.randint(args.min_len, args.max_len))
              for _ in range(args.num_seqs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "model": args.model,
        "num_seqs": args.num_seqs,
        "output_tokens": generated,
        "prompt_tokens": sum(len(p) for p in prompts),
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(generated / elapsed, 1),
        "enforce_eager": args.enforce_eager,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_kv_blocks": llm.engine.num_blocks,
    }
    print(f"{args.model}: {generated} output tokens in {elapsed:.2f} s = "
          f"{generated / elapsed:,.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
