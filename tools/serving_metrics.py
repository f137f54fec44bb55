"""What a serving benchmark reports, computed from per-request records: latency distributions
(TTFT, TPOT, ITL, end-to-end), request and token throughput, goodput under SLOs, output tokens
per second over time, and the printed table. Used by tools/bench_serving.py.
"""

import math
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")  # the keys --goodput accepts, each in milliseconds


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; `start` is relative to the start of
    the benchmark, the others to `start`."""

    prompt_tokens: int
    start: float = 0.0  # when the request was sent
    ttft: float = 0.0  # arrival of the first chunk that carries output
    itl: list[float] = field(default_factory=list)  # gaps between the later output chunks
    latency: float = 0.0  # end of the response (end-to-end latency)
    output_tokens: int = 0  # the server's usage.completion_tokens, else the output chunks
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a single-token output."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def chunk_times(self) -> list[float]:
        """When each output chunk arrived, relative to the start of the benchmark."""
        times = [self.start + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


def distribution(seconds: list[float]) -> dict[str, float | None]:
    """Mean, median, p90 and p99 in milliseconds (numpy's linear interpolation)."""
    if not seconds:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {item!r}: expected NAME:MS with NAME in {SLO_METRICS}")
        slos[name] = float(value)
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """True when a successful request meets every SLO given (a 1-token output has TPOT 0)."""
    measured_ms = {"ttft": record.ttft * 1000, "tpot": (record.tpot or 0.0) * 1000,
                   "e2el": record.latency * 1000}
    return record.ok and all(measured_ms[name] <= limit for name, limit in slos.items())


def output_timeline(records: list[RequestRecord], duration: float,
                    bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive bins of `bin_s` from the benchmark start. A
    request's tokens are spread evenly over its output chunks; the last bin is divided by its
    own (possibly shorter) width."""
    num_bins = max(1, math.ceil(duration / bin_s))
    tokens = np.zeros(num_bins)
    for r in records:
        if not r.ok or r.output_tokens == 0:
            continue
        times = r.chunk_times()
        for t in times:
            tokens[min(int(t // bin_s), num_bins - 1)] += r.output_tokens / len(times)
    widths = np.full(num_bins, bin_s)
    widths[-1] = max(duration - (num_bins - 1) * bin_s, 1e-9) if duration > 0 else bin_s
    return [float(x) for x in tokens / widths]


def summarize(records: list[RequestRecord], duration: float,
              slos: dict[str, float] | None = None) -> dict:
    """The benchmark's numbers; `duration` is the wall time from the first request sent to
    the last response ended. Throughputs count successful requests only."""
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    summary = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) * per_s,
        "input_throughput": input_tokens * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
        "peak_output_throughput": max(output_timeline(ok, duration)) if ok else 0.0,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itl]),
        "e2el_ms": distribution([r.latency for r in ok]),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        summary.update(slos_ms=dict(slos), good_requests=good, goodput=good * per_s)
    return summary


def format_table(summary: dict, title: str = "Serving benchmark") -> str:
    """The summary as a fixed-width text table."""
    width = 60
    rows = [("Successful requests", f"{summary['completed']}"),
            ("Failed requests", f"{summary['failed']}"),
            ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
            ("Total input tokens", f"{summary['total_input_tokens']}"),
            ("Total output tokens", f"{summary['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Input token throughput (tok/s)", f"{summary['input_throughput']:.1f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
            ("Peak output throughput (tok/s, 1 s bins)",
             f"{summary['peak_output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}")]
    if "goodput" in summary:
        slos = " ".join(f"{k}:{v:g}" for k, v in summary["slos_ms"].items())
        rows += [(f"Good requests ({slos})", f"{summary['good_requests']}"),
                 ("Goodput (req/s)", f"{summary['goodput']:.2f}")]
    lines = [f" {title} ".center(width, "="), *(f"{k:<44}{v:>16}" for k, v in rows)]
    lines.append(f"{'(ms)':<12}" + "".join(f"{c:>12}" for c in ("mean", "median", "p90", "p99")))
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                      ("E2E", "e2el_ms")):
        stats = summary[key]
        lines.append(f"{name:<12}" + "".join(
            f"{'-' if stats[c] is None else f'{stats[c]:.2f}':>12}"
            for c in ("mean", "median", "p90", "p99")))
    lines.append("=" * width)
    return "\n".join(lines)
