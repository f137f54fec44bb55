"""What structured outputs cost: the decode step with 64 constrained requests against 64 free
ones, and offline throughput with half the requests JSON-schema constrained against none.
Dummy weights of real shapes (validity means nothing on random weights; cost does).

    python tools/bench_structured.py [--model qwen3-8b] [--tokenizer FOLDER] [--json F]
    ECHO_NVTX=1 python tools/bench_structured.py --skip-offline --profile DIR

--profile (in-process only) runs each variant of the decode measurement once more under the
PyTorch profiler and writes DIR/{free,constrained}.json.gz, for
`tools/overlap_report.py DIR/constrained.json.gz --steps-with bitmask`.

The grammar is compiled against --tokenizer (default: the embedded SmolLM2's, the one
tokenizer the machine is sure to have) with the model's vocabulary size, so the mask has the
model's width (151,936 tokens for Qwen3: 4,748 int32 words per row). The schema asks for an
array of at least 200 objects, so a constrained request stays constrained for all its tokens.
Both variants of each measurement run in one engine, the order alternated.
"""

import argparse
import json
import random
import time
from pathlib import Path

from echo import LLM, SamplingParams, StructuredOutputsParams, envs

SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"], "additionalProperties": False}}


def constrained(params: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=params.temperature, seed=params.seed,
                          max_tokens=params.max_tokens, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


class GrammarTimer:
    """The core's host time on grammars over a run, from the engine's cumulative stats
    (in this process or the core's): advancing matchers and filling masks, per masked step."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.last = llm.stats()

    def take(self) -> dict:
        now, last = self.llm.stats(), self.last
        self.last = now
        steps = max(now.grammar_bitmask_steps - last.grammar_bitmask_steps, 1)
        return {"accept_ms_per_step": 1e3 * (now.grammar_accept_seconds
                                             - last.grammar_accept_seconds) / steps,
                "fill_ms_per_step": 1e3 * (now.grammar_fill_seconds
                                           - last.grammar_fill_seconds) / steps,
                "bitmask_steps": now.grammar_bitmask_steps - last.grammar_bitmask_steps}


class StepClock:
    """Wraps the LLM's wait for the engine's next outputs to stamp each step that brought
    tokens: the median period between them is the steady decode step, apart from the fixed
    costs at a run's start and end (admission, prefill, the last steps) that wall time / tokens
    spreads over every step."""

    def __init__(self, llm: LLM):
        self.stamps: list[float] = []
        next_outputs = llm._next_outputs

        def stamped():
            outputs = next_outputs()
            if outputs is not None and any(o.new_token_ids for o in outputs.outputs):
                self.stamps.append(time.perf_counter())
            return outputs

        llm._next_outputs = stamped

    def take(self, start: float) -> dict:
        stamps, self.stamps = self.stamps, []
        periods = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))  # after the prefill's
        return {"first_tokens_ms": 1e3 * (stamps[0] - start) if stamps else None,
                "median_step_ms": 1e3 * periods[len(periods) // 2] if periods else None,
                "p90_step_ms": 1e3 * periods[9 * len(periods) // 10] if periods else None,
                "steps_with_tokens": len(stamps)}


def timed_generate(llm: LLM, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def decode_variants(vocab: int, args, max_tokens: int) -> tuple[list, dict[str, list]]:
    """64 random prompts, and their sampling params free and constrained."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(64)]
    free = [SamplingParams(temperature=0.6, seed=i, ignore_eos=True, max_tokens=max_tokens)
            for i in range(64)]
    return prompts, {"free": free, "constrained": [constrained(p) for p in free]}


def decode_step(llm: LLM, grammar: GrammarTimer, clock: StepClock, vocab: int, args) -> dict:
    """64 requests decoding together: the median period between steps (the step the
    acceptance bounds), and wall time / output tokens per request, which adds the run's fixed
    costs (admission, prefill)."""
    prompts, variants = decode_variants(vocab, args, args.decode_tokens)
    result = {}
    for round_ in range(2):
        for name in (list(variants) if round_ == 0 else list(variants)[::-1]):
            grammar.take()
            start = time.perf_counter()
            elapsed, tokens = timed_generate(llm, prompts, variants[name])
            entry = {"wall_ms_per_token": 1e3 * elapsed / args.decode_tokens,
                     "tokens": tokens, **clock.take(start), **grammar.take()}
            result.setdefault(name, []).append(entry)
    best = {name: min(runs, key=lambda r: r["median_step_ms"]) for name, runs in result.items()}
    best["all_runs"] = result
    step = {name: best[name]["median_step_ms"] for name in variants}
    best["step_increase"] = step["constrained"] / step["free"] - 1
    best["wall_increase"] = (min(r["wall_ms_per_token"] for r in result["constrained"])
                             / min(r["wall_ms_per_token"] for r in result["free"]) - 1)
    return best


def profile_decode(llm: LLM, vocab: int, args) -> None:
    """Each variant's 64-request decode again, shorter, under the PyTorch profiler (kernels
    and echo's ranges: where the constrained step's extra time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prompts, variants = decode_variants(vocab, args, args.profile_tokens)
    args.profile.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    for name, params in variants.items():
        with profile(activities=activities) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        prof.export_chrome_trace(str(args.profile / f"{name}.json.gz"))
        print(f"profiled {name}: {args.profile / f'{name}.json.gz'}", flush=True)


def offline(llm: LLM, grammar: GrammarTimer, vocab: int, args) -> dict:
    """nano-vllm's workload (lengths uniform in [100, 1024]); half the requests constrained."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))]
               for _ in range(args.num_seqs)]
    free = [SamplingParams(temperature=0.6, seed=i, ignore_eos=True,
                           max_tokens=rng.randint(100, 1024)) for i in range(args.num_seqs)]
    half = [constrained(p) if i % 2 else p for i, p in enumerate(free)]
    runs: dict[str, list] = {}
    # free, half, half, free: each variant once early and once late in the run
    for name, params in (("free", free), ("half_constrained", half),
                         ("half_constrained", half), ("free", free)):
        grammar.take()
        elapsed, tokens = timed_generate(llm, prompts, params)
        runs.setdefault(name, []).append({"tokens_per_s": tokens / elapsed, "seconds": elapsed,
                                          "tokens": tokens, **grammar.take()})
    result = {name: max(r, key=lambda e: e["tokens_per_s"]) for name, r in runs.items()}
    result["all_runs"] = runs
    result["ratio"] = result["half_constrained"]["tokens_per_s"] / result["free"]["tokens_per_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--engine-process", action="store_true",
                        help="the core in its own process (as the server runs it): its grammar "
                             "work then no longer shares a thread with the frontend's")
    parser.add_argument("--grammar-processes", type=int, default=None,
                        help="the engine's grammar_processes (0: the core's busy loop; "
                             "default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR")
    parser.add_argument("--profile-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.profile is not None and (args.engine_process or not envs.nvtx_enabled()):
        parser.error("--profile needs the core in this process and ECHO_NVTX=1")
    if args.tokenizer is None:
        from echo.models.default_model import ensure_default_model

        args.tokenizer = str(ensure_default_model())
    llm = LLM(args.model, load_format="dummy", tokenizer=args.tokenizer, max_model_len=4096,
              max_num_seqs=args.max_num_seqs, engine_process=args.engine_process,
              grammar_processes=args.grammar_processes)
    vocab = min(llm.config.model.arch.vocab_size, 49152)  # prompt ids the tokenizer knows
    warm = [[1] * 64] * 8
    llm.generate(warm, [constrained(SamplingParams(max_tokens=16))] * 8, use_tqdm=False)
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    clock = StepClock(llm)
    grammar = GrammarTimer(llm)
    report = {"model": args.model, "decode_64": decode_step(llm, grammar, clock, vocab, args)}
    d = report["decode_64"]
    report["engine_process"] = args.engine_process
    report["grammar_processes"] = llm.config.scheduler.grammar_processes
    free, bound = d["free"], d["constrained"]
    print(f"decode, 64 requests: median step free {free['median_step_ms']:.2f} ms, constrained "
          f"{bound['median_step_ms']:.2f} ms ({100 * d['step_increase']:+.1f}%); wall per token "
          f"{free['wall_ms_per_token']:.2f} / {bound['wall_ms_per_token']:.2f} ms "
          f"({100 * d['wall_increase']:+.1f}%); first tokens after {free['first_tokens_ms']:.0f}"
          f" / {bound['first_tokens_ms']:.0f} ms; the core's accept + fill "
          f"{bound['accept_ms_per_step']:.2f} + {bound['fill_ms_per_step']:.2f} ms a step",
          flush=True)
    if args.profile is not None:
        profile_decode(llm, vocab, args)
    if not args.skip_offline:
        report["offline"] = o = offline(llm, grammar, vocab, args)
        print(f"offline, {args.num_seqs} requests: free {o['free']['tokens_per_s']:.0f} tok/s, "
              f"half constrained {o['half_constrained']['tokens_per_s']:.0f} tok/s "
              f"({100 * o['ratio']:.1f}%)", flush=True)
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
