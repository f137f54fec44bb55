"""Where a speculative step's time goes at batch 1: wall time per call of the engine's and
runner's phases (schedule, launch, verify, the drafter's propose, update), and a PyTorch
profiler table of a few steps (host syncs and copies included).

    python tools/dev/probe_spec_step.py [--model llama-3.1-8b] [--method eagle3|draft_model]
        [--draft qwen3-0.6b] [--tokens 128]

eagle3 uses a random head shaped for the target (tools/bench_spec.py); dummy weights, so
every draft is rejected and each step verifies k drafts and proposes k more.
"""

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_spec import make_prompts, write_random_eagle3_head  # noqa: E402

from echo import LLM, SamplingParams  # noqa: E402


def timed(owner, name: str, totals: dict) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            entry = totals[name]
            entry[0] += time.perf_counter() - start
            entry[1] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--method", default="eagle3")
    parser.add_argument("--draft", default="qwen3-0.6b")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        draft = args.draft
        if args.method == "eagle3":
            draft = str(write_random_eagle3_head(Path(folder) / "head", args.model, "dummy",
                                                 32000))
        spec = {"method": args.method, "model": draft, "num_speculative_tokens": args.k}
        llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=1,
                  enable_prefix_caching=False, speculative_config=spec)
        try:
            prompts = make_prompts(llm.config.model.arch.vocab_size, 1, 256)
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.tokens)
            llm.generate(prompts, params, use_tqdm=False)  # warm-up
            engine, runner = llm.engine, llm.engine.executor.runner
            totals = defaultdict(lambda: [0.0, 0])
            for owner, name in ((engine.scheduler, "schedule"),
                                (engine.scheduler, "update_from_output"),
                                (runner, "launch"), (runner, "collect"), (runner, "_verify"),
                                (runner, "forward"), (runner.drafter, "propose"),
                                (runner.drafter, "_decode")):
                if hasattr(owner, name):
                    timed(owner, name, totals)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            steps = totals["schedule"][1]
            print(f"{args.method}: {wall * 1e3:.1f} ms for {args.tokens} tokens, {steps} steps: "
                  f"{wall * 1e3 / steps:.3f} ms per step")
            for name, (seconds, calls) in totals.items():
                print(f"  {name:<20} {calls:5d} calls  {seconds * 1e3 / max(steps, 1):8.3f} "
                      "ms per step")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, SamplingParams(temperature=0, ignore_eos=True,
                                                     max_tokens=17), use_tqdm=False)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
