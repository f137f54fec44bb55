"""The host's work between one verification's tokens landing and the next verification's
forward starting, with the oracle proposer at batch 1: with one step in flight the device waits
through all of it (docs/benchmarks.md, Speculative decoding).

    python tools/dev/probe_spec_gap.py [--model llama-3.1-8b] [--acceptance 0.77] [-k 4]
        [--tokens 256] [--device cuda|cpu]

Records the target's greedy continuations (no speculation, token-determined weights as
tools/bench_spec.py sets them), then decodes the same prompt with the oracle. Timestamps: the
verification's tokens on the host ("landed": model_runner._landed returns), entry and exit of
the engine's and the runner's phases, and the model's forward call (graph replay or eager).
Prints the median offset of each mark from "landed" over the steady steps, and the median gap.
On the CPU (a tiny random Llama, --model ignored) the same marks time the same Python.
"""

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_spec import in_fresh_process, make_logits_token_determined, time_decode  # noqa: E402

from echo import LLM, SamplingParams  # noqa: E402
from echo.core.oracle_proposer import save_continuations  # noqa: E402
from echo.worker import model_runner  # noqa: E402


def mark_calls(owner, name: str, marks: list) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        marks.append((name + " >", time.perf_counter()))
        try:
            return inner(*args, **kwargs)
        finally:
            marks.append((name + " <", time.perf_counter()))

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--acceptance", type=float, default=0.77)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        engine = {"model": args.model, "load_format": "dummy", "max_model_len": 4096,
                  "max_num_seqs": 1, "enable_prefix_caching": False}
        if args.device == "cpu":
            from tests.helpers import write_tiny_model

            model = write_tiny_model(Path(folder) / "tiny", "llama", tie=True)
            engine = {"model": str(model), "device": "cpu", "max_model_len": 512,
                      "max_num_seqs": 1, "enable_prefix_caching": False}
            args.input_len = min(args.input_len, 64)
        rng = np.random.default_rng(0)
        vocab = 128 if args.device == "cpu" else 32000
        prompt = rng.integers(3, vocab, size=args.input_len).tolist()
        base = in_fresh_process(time_decode, {**engine, "token_determined": True}, [prompt],
                                args.tokens, 1)
        oracle = Path(folder) / "oracle.json"
        save_continuations(oracle, {tuple(prompt): base["outputs"][0][0]})
        llm = LLM(**engine, speculative_config={
            "method": "oracle", "num_speculative_tokens": args.k, "oracle_path": str(oracle),
            "oracle_acceptance": args.acceptance})
        try:
            make_logits_token_determined(llm)
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.tokens)
            llm.generate([prompt], params, use_tqdm=False)  # warm-up
            marks: list[tuple[str, float]] = []
            runner = llm.engine.executor.runner
            land = model_runner._landed

            def landed(tensor):
                host = land(tensor)
                marks.append(("landed", time.perf_counter()))
                return host

            model_runner._landed = landed
            graphs = runner.graphs
            if graphs is not None:
                mark_calls(graphs, "replay", marks)
            mark_calls(runner.model, "forward", marks)
            scheduler = llm.engine.scheduler
            for owner, name in ((scheduler, "update_from_output"), (scheduler, "schedule"),
                                (scheduler, "propose_drafts"), (runner, "launch"),
                                (runner, "collect"), (runner, "_verify"),
                                (runner.buffers, "load"), (runner.input_batch, "prepare"),
                                (runner.input_batch, "update"), (llm, "_next_outputs")):
                mark_calls(owner, name, marks)
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            wall = time.perf_counter() - start
        finally:
            llm.shutdown()
    landings = [i for i, (name, _) in enumerate(marks) if name == "landed"]
    offsets: dict[str, list[float]] = defaultdict(list)
    gaps = []
    for i in landings[4:-4]:  # steady steps
        t0 = marks[i][1]
        seen = set()
        for name, t in marks[i + 1:]:
            if name in seen:
                continue
            seen.add(name)
            offsets[name].append((t - t0) * 1e6)
            if name in ("replay >", "forward >"):
                gaps.append((t - t0) * 1e6)
                break
    print(f"{len(landings)} verification steps, {wall * 1e3 / len(landings):.3f} ms per step; "
          f"median gap landed -> next forward: {np.median(gaps):.1f} µs "
          f"(p10 {np.percentile(gaps, 10):.1f}, p90 {np.percentile(gaps, 90):.1f})")
    for name, values in sorted(offsets.items(), key=lambda item: np.median(item[1])):
        print(f"  {np.median(values):9.1f} µs  {name}")


if __name__ == "__main__":  # spawns a process: keep this guard
    main()
