"""Host-side cost of one engine step, with the model taken out.

Runs the in-process LLM (two steps in flight) on a tiny random Llama written to a temporary
folder, with the model's forward replaced by a stub that still uploads the step's inputs. What
is left is everything the CPU does per step: scheduling, input preparation, sampling inputs,
the sampler on tiny logits, landing tokens, updating requests, output processing. On the GPU
this work must hide behind the device's step time, so it bounds throughput at small models.

    python tools/bench_step_overhead.py [--sizes 1 16 64 256] [--steps 200]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout too

from echo import LLM, SamplingParams  # noqa: E402
from tests.helpers import VOCAB, write_tiny_model  # noqa: E402


def stub_forward(runner):
    hidden_size = runner.arch.hidden_size

    def forward(inp):
        runner.buffers.load(inp)  # keep the real upload work
        return torch.zeros(len(inp.input_ids), hidden_size, device=runner.device)

    return forward


def ms_per_step(llm: LLM, batch: int, steps: int, prompt_len: int) -> float:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, size=prompt_len).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    # one prefill step, then `steps` decode steps
    return (time.perf_counter() - start) / (steps + 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = write_tiny_model(Path(folder), "llama", tie=True)
        llm = LLM(str(model), device="cpu", num_gpu_blocks_override=40_000,
                  max_num_seqs=max(args.sizes), max_model_len=512,
                  max_num_batched_tokens=max(16384, max(args.sizes) * args.prompt_len))
        llm.engine.executor.runner.forward = stub_forward(llm.engine.executor.runner)
        print(f"{'requests':>8}  {'ms/step':>8}  {'µs/request':>10}")
        for batch in args.sizes:
            ms = ms_per_step(llm, batch, args.steps, args.prompt_len)
            print(f"{batch:>8}  {ms:>8.2f}  {ms * 1e3 / batch:>10.1f}")


if __name__ == "__main__":
    main()
