"""Online serving benchmark against any OpenAI-compatible server (echo, vLLM, SGLang).

Sends --num-prompts streamed requests, arriving as a Poisson process at --request-rate req/s
(inf: all at once) and/or capped at --max-concurrency in flight, and reports TTFT, TPOT, ITL
and end-to-end latency (mean, median, p90, p99), request and token throughput, and goodput
under SLOs. Prompts are synthetic and seeded; nothing is downloaded.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --dataset random \\
        --input-len 1024 --output-len 128 --num-prompts 200 --request-rate 8 \\
        --goodput ttft:500 tpot:50 --result-json out/serve.json --plot-dir out/plots

TPOT = (e2e - ttft) / (output_tokens - 1) per request; ITL = gaps between output chunks (a
chunk carrying several tokens makes one longer gap). Output tokens come from the server's
usage when it streams one (stream_options.include_usage), else from the chunk count.

Every time is read from the event loop's clock (loop.time(), monotonic), the one the arrival
schedule sleeps on. main() also takes an httpx transport and an event-loop factory: the tests
run it against an in-process fake server on a loop whose clock is virtual.
"""

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper modules beside this one

from serving_client import send_request  # noqa: E402
from serving_metrics import (  # noqa: E402
    RequestRecord,
    format_table,
    output_timeline,
    parse_slos,
    summarize,
)

# Common English words: roughly one token each (with the leading space) in BPE vocabularies.
WORDS = ("the of and to in is was for on that with as by at from his he it an were are which "
         "this be or had not first one their its new after but who they have her she two been "
         "other when there all during into school time may years more most only over city "
         "some world would where later up such used many can state about national out known "
         "university united then made").split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens: exact for token ids, about right for words
    output_len: int


def make_prompt(rng: random.Random, length: int, as_text: bool,
                vocab_size: int) -> str | list[int]:
    if as_text:
        return " ".join(rng.choice(WORDS) for _ in range(length))
    return [rng.randrange(vocab_size) for _ in range(length)]


def random_requests(args: argparse.Namespace, as_text: bool) -> list[BenchRequest]:
    """Lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        lo = max(1, math.floor(mean * (1 - args.range_ratio)))
        return rng.randint(lo, max(lo, math.ceil(mean * (1 + args.range_ratio))))

    requests = []
    for _ in range(args.num_prompts):
        input_len, output_len = length(args.input_len), length(args.output_len)
        requests.append(BenchRequest(make_prompt(rng, input_len, as_text, args.vocab_size),
                                     input_len, output_len))
    return requests


def sharegpt_synthetic_requests(args: argparse.Namespace, as_text: bool) -> list[BenchRequest]:
    """ShareGPT-like lengths: lognormal with the given means (before filtering) and log-space
    sigma, redrawn until 4 <= input <= --sharegpt-max-input and input + output <=
    --sharegpt-max-total with output >= 4, as vLLM filters the real ShareGPT set."""
    rng = random.Random(args.seed)
    sigma = args.sharegpt_sigma

    def draw(mean: float) -> int:
        return round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))

    requests = []
    while len(requests) < args.num_prompts:
        input_len, output_len = draw(args.sharegpt_input_mean), draw(args.sharegpt_output_mean)
        if (4 <= input_len <= args.sharegpt_max_input and output_len >= 4
                and input_len + output_len <= args.sharegpt_max_total):
            requests.append(BenchRequest(make_prompt(rng, input_len, as_text, args.vocab_size),
                                         input_len, output_len))
    return requests


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process (exponential gaps, the first
    request at 0), or all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    offsets = [0.0]
    while len(offsets) < num:
        offsets.append(offsets[-1] + rng.expovariate(rate))
    return offsets[:num]


def build_payload(args: argparse.Namespace, model: str, request: BenchRequest) -> dict:
    payload: dict = {"model": model, "max_tokens": request.output_len, "stream": True,
                     "stream_options": {"include_usage": True},
                     "temperature": args.temperature}
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if is_chat(args):
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    payload.update(args.extra_body)
    return payload


def is_chat(args: argparse.Namespace) -> bool:
    return args.endpoint.rstrip("/").endswith("chat/completions")


async def first_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run(args: argparse.Namespace, requests: list[BenchRequest],
              transport: httpx.AsyncBaseTransport | None = None,
              ) -> tuple[str, list[RequestRecord], float]:
    """Send every request on its schedule; returns the model, the records and the duration.
    transport: httpx's own (None) or, in tests, an in-process server."""
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    clock = asyncio.get_running_loop().time
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                 transport=transport) as client:
        model = args.model or await first_model(client, base_url, headers)
        url = base_url + args.endpoint
        gate = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)

        async def one(request: BenchRequest, bench_start: float) -> RequestRecord:
            async with gate:
                return await send_request(client, url, build_payload(args, model, request),
                                          headers, request.prompt_len, bench_start, clock)

        offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
        bench_start = clock()
        tasks = []
        for request, offset in zip(requests, offsets):
            delay = bench_start + offset - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request, bench_start)))
        records = await asyncio.gather(*tasks)
        return model, records, clock() - bench_start


def write_plots(records: list[RequestRecord], timeline: list[float], duration: float,
                plot_dir: Path, title: str) -> list[Path]:
    """latency_cdf.png (TTFT, TPOT, ITL, E2E) and throughput.png (output tok/s, 1 s bins)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    plot_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.ok]
    series = {"TTFT": [r.ttft for r in ok],
              "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL (per chunk)": [gap for r in ok for gap in r.itl],
              "E2E latency": [r.latency for r in ok]}
    fig = Figure(figsize=(11, 7.5))
    FigureCanvasAgg(fig)
    for ax, (name, values) in zip(fig.subplots(2, 2).flat, series.items()):
        if values:
            ms = np.sort(np.asarray(values)) * 1000
            ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), drawstyle="steps-post")
        ax.set(title=name, xlabel="ms", ylabel="cumulative fraction", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    cdf_path = plot_dir / "latency_cdf.png"
    fig.savefig(cdf_path, dpi=110)

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    edges = np.append(np.arange(len(timeline), dtype=float), max(duration, len(timeline) - 1))
    ax.stairs(timeline, edges, linewidth=1.5)
    ax.set(title=f"Output tokens/s over time - {title}", xlabel="seconds since start",
           ylabel="output tokens/s (1 s bins)", ylim=(0, None))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    throughput_path = plot_dir / "throughput.png"
    fig.savefig(throughput_path, dpi=110)
    return [cdf_path, throughput_path]


def per_request(records: list[RequestRecord]) -> dict[str, list]:
    return {"start_s": [r.start for r in records],
            "prompt_tokens": [r.prompt_tokens for r in records],
            "output_tokens": [r.output_tokens for r in records],
            "ttft_ms": [r.ttft * 1000 for r in records],
            "tpot_ms": [None if r.tpot is None else r.tpot * 1000 for r in records],
            "e2el_ms": [r.latency * 1000 for r in records],
            "itl_ms": [[gap * 1000 for gap in r.itl] for r in records],
            "error": [r.error for r in records]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", help="default: the first id /v1/models lists")
    p.add_argument("--api-key", help="sent as a Bearer token")
    p.add_argument("--dataset", default="random", choices=["random", "sharegpt-synthetic"])
    p.add_argument("--prompt-type", choices=["tokens", "text"],
                   help="token-id lists (completions only) or random words; default: tokens "
                        "for /v1/completions, text for chat")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="random: max_tokens")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--sharegpt-input-mean", type=float, default=250.0)
    p.add_argument("--sharegpt-output-mean", type=float, default=220.0)
    p.add_argument("--sharegpt-sigma", type=float, default=1.0, help="lognormal log-space sigma")
    p.add_argument("--sharegpt-max-input", type=int, default=1024)
    p.add_argument("--sharegpt-max-total", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids drawn below this")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos (--no-ignore-eos for servers without it)")
    p.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request, e.g. \'{"min_tokens": 8}\'')
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may wait for its next bytes")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="SLOs a good request meets, from ttft, tpot, e2el (ms)")
    p.add_argument("--result-json", type=Path, help="write config, summary and per-request data")
    p.add_argument("--plot-dir", type=Path, help="write latency_cdf.png and throughput.png")
    args = p.parse_args(argv)
    try:
        args.slos = parse_slos(args.goodput)
    except ValueError as e:
        p.error(str(e))
    args.prompt_type = args.prompt_type or ("text" if is_chat(args) else "tokens")
    if args.prompt_type == "tokens" and is_chat(args):
        p.error("token-id prompts need /v1/completions; use --prompt-type text for chat")
    return args


def main(argv: list[str] | None = None, *, transport: httpx.AsyncBaseTransport | None = None,
         loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> dict:
    args = parse_args(argv)
    make = random_requests if args.dataset == "random" else sharegpt_synthetic_requests
    requests = make(args, as_text=args.prompt_type == "text")
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        model, records, duration = runner.run(run(args, requests, transport))
    summary = summarize(records, duration, args.slos)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    title = f"{model} {args.dataset} rate={rate} concurrency={args.max_concurrency or '-'}"
    print(format_table(summary, title))
    for error in sorted({r.error for r in records if r.error})[:5]:
        print(f"error: {error}")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config |= {"model": model, "request_rate": "inf" if rate == "inf" else args.request_rate,
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    result = {"config": config, "summary": summary,
              "output_throughput_timeline": output_timeline(records, duration),
              "requests": per_request(records)}
    if args.plot_dir:
        paths = write_plots(records, result["output_throughput_timeline"], duration,
                            args.plot_dir, title)
        print("plots: " + ", ".join(str(p) for p in paths))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=1))
        print(f"results: {args.result_json}")
    return result


if __name__ == "__main__":
    main()
