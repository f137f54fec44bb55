"""Decode latency of a fixed batch: time per output token once the prompt is in the cache.

    python tools/bench_latency.py [--model llama-3.1-8b] [--batch-size 1] [--input-len 256]
        [--output-len 256] [--iters 3] [--tp N | --rank-share-of N] [--json F]

Each iteration generates the batch twice with identical prompts: once for one token (prefill
alone) and once for --output-len tokens; the difference divided by the extra tokens is the time
per decode step, free of start-up, JIT compilation (a warm-up of the same shapes runs first)
and prefill. Prefix caching is off so every run prefills. Prints the median over iterations.

--rank-share-of N times, on one GPU, what one rank of a tp=N run computes: the model with its
attention heads, KV heads, intermediate size and vocabulary divided as tp=N divides them, and
no communication. Against --tp N, the difference is what the all-reduces and the logits'
all-gather cost.
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from echo import LLM, SamplingParams
from echo.models.arch import PRESETS_DIR, preset_names, read_config_json


def rank_share_config(hf_config: dict, tp: int) -> dict:
    """The config of one rank's share of a tp-way model: the shapes every weight and the KV
    cache of that rank have (KV heads replicated when tp exceeds them)."""
    share = dict(hf_config)
    share["head_dim"] = hf_config.get("head_dim") or (
        hf_config["hidden_size"] // hf_config["num_attention_heads"])
    share["num_attention_heads"] = hf_config["num_attention_heads"] // tp
    kv_heads = hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])
    share["num_key_value_heads"] = max(1, kv_heads // tp)
    share["intermediate_size"] = hf_config["intermediate_size"] // tp
    share["vocab_size"] = -(-hf_config["vocab_size"] // tp)
    return share


def write_rank_share(model: str, tp: int, folder: Path) -> str:
    """A weightless model folder holding rank_share_config of a preset or a model folder."""
    source = PRESETS_DIR / f"{model}.json" if model in preset_names() else \
        Path(model) / "config.json"
    (folder / "config.json").write_text(
        json.dumps(rank_share_config(read_config_json(source), tp), indent=1))
    return str(folder)


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
    parser.add_argument("--rank-share-of", type=int, metavar="N",
                        help="one rank's share of a tp=N model, on one GPU (see above)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.output_len < 2:
        parser.error("--output-len must be at least 2")
    if args.rank_share_of is not None and (args.rank_share_of < 1 or args.tp != 1
                                           or args.load_format != "dummy"):
        parser.error("--rank-share-of takes N >= 1 and runs on one GPU (--tp 1) with random "
                     "weights (--load-format dummy)")
    with tempfile.TemporaryDirectory() as folder:
        model = args.model if args.rank_share_of is None else \
            write_rank_share(args.model, args.rank_share_of, Path(folder))
        measure(args, model)


def measure(args, model: str) -> None:
    llm = LLM(model, load_format=args.load_format, max_model_len=args.max_model_len,
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
              "rank_share_of": args.rank_share_of,
              "prefill_ms": round(statistics.median(prefill_s) * 1e3, 2),
              "decode_ms_per_step": round(ms, 3),
              "decode_tok_per_s": round(args.batch_size * 1e3 / ms, 1)}
    share = "" if args.rank_share_of is None else f" (one rank's share of tp={args.rank_share_of})"
    print(f"{args.model}{share} B={args.batch_size} in={args.input_len} out={args.output_len}: "
          f"prefill {result['prefill_ms']} ms, decode {ms:.3f} ms/step "
          f"({result['decode_tok_per_s']:,} tok/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":  # the engine's processes may be spawned: keep this guard
    main()
