"""Decode latency of a fixed batch: time per output token once the prompt is in the cache.

    python tools/bench_latency.py [--model llama-3.1-8b] [--batch-size 1] [--input-len 256]
        [--output-len 256] [--iters 3] [--num-scheduler-steps N] [--tp N | --rank-share-of N]
        [--json F]

Each iteration generates the batch twice with identical prompts: once for one token (prefill
alone) and once for --output-len tokens; the difference divided by the extra tokens is the time
per decode step, free of start-up, JIT compilation (a warm-up of the same shapes runs first)
and prefill. Prefix caching is off so every run prefills. Prints the median over iterations.

Next to it: the host's busy time per step (wall time less the time the engine waited for the
device's tokens; when it reaches the step time, the host bounds the step), and, with CUDA graphs
and one rank, the device time per step: the captured decode graph of the batch (and with
--num-scheduler-steps > 1 its sampling graph) replayed back to back, timed with CUDA events.

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
    parser.add_argument("--persistent-decode", action="store_true",
                        help="batch-1 decode steps in one persistent launch")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="decode steps per launch (the engine argument)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank-share-of", type=int, metavar="N",
                        help="one rank's share of a tp=N model, on one GPU (see above)")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also print the N kernels that take most of the device step (the "
                             "replayed graphs under the PyTorch profiler)")
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
              tensor_parallel_size=args.tp, num_scheduler_steps=args.num_scheduler_steps,
              persistent_decode=args.persistent_decode)
    runner = getattr(llm.engine.executor, "runner", None) if llm.engine else None
    rng = random.Random(0)
    vocab = llm.config.model.arch.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.batch_size)]

    def run(tokens: int) -> tuple[float, float | None]:
        """Wall seconds, and seconds of it the host was busy (None: not known here)."""
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
        waited = runner.device_wait_s if runner else 0.0
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return wall, (wall - (runner.device_wait_s - waited) if runner else None)

    run(args.output_len)  # warm-up: every kernel shape of the measured runs compiled here
    prefill_s, per_token_s, host_per_token_s = [], [], []
    for _ in range(args.iters):
        prefill, prefill_host = run(1)
        full, full_host = run(args.output_len)
        prefill_s.append(prefill)
        per_token_s.append((full - prefill) / (args.output_len - 1))
        if runner:
            host_per_token_s.append((full_host - prefill_host) / (args.output_len - 1))
    ms = statistics.median(per_token_s) * 1e3
    host_ms = statistics.median(host_per_token_s) * 1e3 if host_per_token_s else None
    device_ms = device_step_ms(runner, args.batch_size)
    kernels = kernel_breakdown(runner, args.batch_size, args.kernels) if args.kernels else []
    result = {"model": args.model, "batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "kv_cache_dtype": args.kv_cache_dtype,
              "enforce_eager": args.enforce_eager, "tp": args.tp,
              "persistent_decode": args.persistent_decode,
              "rank_share_of": args.rank_share_of,
              "prefill_ms": round(statistics.median(prefill_s) * 1e3, 2),
              "decode_ms_per_step": round(ms, 3),
              "decode_tok_per_s": round(args.batch_size * 1e3 / ms, 1),
              "num_scheduler_steps": args.num_scheduler_steps,
              "host_ms_per_step": None if host_ms is None else round(host_ms, 3),
              "device_ms_per_step": None if device_ms is None else round(device_ms, 3),
              "kernels_us_per_step": kernels}
    share = "" if args.rank_share_of is None else f" (one rank's share of tp={args.rank_share_of})"
    print(f"{args.model}{share} B={args.batch_size} in={args.input_len} out={args.output_len}: "
          f"prefill {result['prefill_ms']} ms, decode {ms:.3f} ms/step "
          f"({result['decode_tok_per_s']:,} tok/s), steps/launch {args.num_scheduler_steps}; "
          f"host busy {result['host_ms_per_step']} ms/step, device "
          f"{result['device_ms_per_step']} ms/step")
    for name, calls, us in kernels:
        print(f"  {us:8.1f} us/step  {calls:4d} calls/step  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def graph_step(runner, batch_size: int):
    """Replays the batch's decode graph (and its sampling graph) over the last step's inputs;
    None without graphs. The replays write K/V into the slots of a finished request's last
    step: nothing reads them."""
    graphs = runner.graphs if runner else None
    size = graphs.padded_size(batch_size) if graphs else None
    if size is None:
        return None
    multi = runner.multi_step
    sample = multi.sample_graphs.get(size) if multi else None

    def step():
        graphs.replay(size)
        if sample is not None:
            sample[0].replay()

    return step


def device_step_ms(runner, batch_size: int, iters: int = 200) -> float | None:
    """Device ms per decode step: the graphs replayed back to back, CUDA events around."""
    import torch

    step = graph_step(runner, batch_size)
    if step is None:
        return None
    for _ in range(10):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def kernel_breakdown(runner, batch_size: int, top: int, steps: int = 20) -> list:
    """(kernel, calls per step, µs per step) of the replayed graphs, most time first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step = graph_step(runner, batch_size)
    if step is None:
        return []
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return [(name, calls // steps, round(us / steps, 1)) for name, (calls, us) in rows[:top]]


if __name__ == "__main__":  # the engine's processes may be spawned: keep this guard
    main()
