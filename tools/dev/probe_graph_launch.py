"""How long the host spends launching a step's CUDA graph, against the time the GPU runs it:
with one step in flight (speculative decoding) the launch is not hidden behind the step
before, so its host time adds to every step.

    python tools/dev/probe_graph_launch.py [--model llama-3.1-8b] [-k 4] [--iters 50]

Replays the decode graph (query length 1) and the verification graph (1 + k) of batch 1 of an
idle engine (dummy weights; the replays write KV into slots no request holds), timing the
replay call on the host and, after a sync, the GPU's time for it.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from echo import LLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, max_num_seqs=1,
              enable_prefix_caching=False, speculative_config=spec)
    try:
        graphs = llm.engine.executor.runner.graphs
        for query_len in (1, 1 + args.k):
            host, total = [], []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                start = time.perf_counter()
                graphs.replay(1, query_len)
                launched = time.perf_counter()
                torch.cuda.synchronize()
                host.append(launched - start)
                total.append(time.perf_counter() - start)
            print(f"batch 1, query length {query_len}: launch {statistics.median(host) * 1e6:.0f}"
                  f" us on the host, {statistics.median(total) * 1e3:.3f} ms to the end of the "
                  "graph")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
