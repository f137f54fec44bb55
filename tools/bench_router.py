"""Microseconds per routing decision (Router.choose + finished) with stub replicas, no engine.

    python tools/bench_router.py [--replicas 2] [--policy cache_aware] [--requests 5000]
        [--rate 1000] [--seed 0] [--json F]

The workload (seeded): most requests start with one of --groups shared system prompts of
512-1,536 tokens, picked with Zipf weights so some are hot, then a unique 64-512-token tail; the
rest (--unrelated) are unrelated prompts of 512-2,048 tokens. Requests arrive paced at --rate
per second of wall time (0: as fast as the loop goes). The stub replicas run on a simulated
clock (request i arrives at i / rate seconds, or i / 1000 with --rate 0): each request takes an
exponential service time (mean --service-ms) and is then reported finished() to the router, so
its in-flight counts evolve as a server's would; every 10 ms of simulated time each replica
reports its load through update_stats.

Each stub also keeps its own LRU of the block hashes it served (--replica-cache-blocks): the
ground truth of which replica holds a request's longest cached prefix, against which the
router's choice is scored (`longest prefix`, over requests some replica holds a prefix of), and
the share of prompt tokens the chosen replica already held (`prefix reuse`).

Timed with perf_counter_ns: choose() alone, and per request choose() plus the finished() calls
made just before it (one per request on average, the steady cost of a request). update_stats
and the stubs' own work are not timed.
"""

import argparse
import gc
import heapq
import json
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout too

from echo.engine.router import ROUTING_POLICIES, Router, block_hashes  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 32_000
POOL_TOKENS = 1 << 18  # tails and unrelated prompts are slices of one random pool
STATS_EVERY_S = 0.010
MAX_RUNNING = 256  # a stub's running batch; beyond it requests count as waiting


class StubReplica:
    """A replica's load and prefix cache, on the simulated clock."""

    def __init__(self, cache_blocks: int):
        self.cache_blocks = cache_blocks
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.in_service = 0
        self.served = 0

    def matched(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def serve(self, hashes: list[int]) -> None:
        self.in_service += 1
        self.served += 1
        cache = self.cache
        for h in reversed(hashes):  # the head is evicted last, as the engine frees tails first
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        for _ in range(len(cache) - self.cache_blocks):
            cache.popitem(last=False)


def workload(args):
    """(prompt token ids, cache_salt) per request, made lazily to keep memory flat."""
    rng = random.Random(args.seed)
    pool = [rng.randrange(VOCAB) for _ in range(POOL_TOKENS)]
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(512, 1536))]
               for _ in range(args.groups)]
    weights = [1 / (k + 1) for k in range(args.groups)]
    for i in range(args.requests):
        unique = VOCAB + i  # a token no other request has: every tail differs from its start
        if rng.random() < args.unrelated:
            length = rng.randint(512, 2048)
            head: list[int] = []
        else:
            head = rng.choices(systems, weights)[0]
            length = rng.randint(64, 512)
        start = rng.randrange(POOL_TOKENS - length)
        yield head + [unique] + pool[start:start + length - 1], None


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summary_us(ns: list[int]) -> dict:
    values = sorted(v / 1000 for v in ns)
    return {"p50_us": percentile(values, 0.50), "p99_us": percentile(values, 0.99),
            "max_us": values[-1], "mean_us": sum(values) / len(values)}


def run(args) -> dict:
    router = Router(args.replicas, args.policy, block_size=BLOCK_SIZE)
    stubs = [StubReplica(args.replica_cache_blocks) for _ in range(args.replicas)]
    rng = random.Random(args.seed + 1)
    sim_rate = args.rate or 1000.0
    mean_service_s = args.service_ms / 1000
    pending: list[tuple[float, int, int]] = []  # (finish time, request, replica)
    choose_ns, total_ns = [], []
    held_prefix = on_longest = 0
    reused_tokens = prompt_tokens = 0
    max_skew = 0
    next_stats = 0.0
    clock = time.perf_counter_ns

    gc.collect()
    wall_start = time.perf_counter()
    for i, (prompt, salt) in enumerate(workload(args)):
        if args.rate:
            ahead = wall_start + i / args.rate - time.perf_counter()
            if ahead > 0.0002:
                time.sleep(ahead)
        now = i / sim_rate
        if now >= next_stats:  # the replicas' periodic load reports
            for index, stub in enumerate(stubs):
                running = min(stub.in_service, MAX_RUNNING)
                router.update_stats(index, running, stub.in_service - running,
                                    len(stub.cache) / stub.cache_blocks)
            next_stats = now + STATS_EVERY_S

        t0 = clock()
        while pending and pending[0][0] <= now:
            _, _, index = heapq.heappop(pending)
            router.finished(index)
            stubs[index].in_service -= 1
        t1 = clock()
        index = router.choose(prompt, salt)
        t2 = clock()
        choose_ns.append(t2 - t1)
        total_ns.append(t2 - t0)

        # the ground truth, untimed: who held the longest prefix, and what the chosen one had
        hashes = block_hashes(prompt, BLOCK_SIZE, salt)
        matches = [stub.matched(hashes) for stub in stubs]
        longest = max(matches)
        if longest:
            held_prefix += 1
            on_longest += matches[index] == longest
        reused_tokens += matches[index] * BLOCK_SIZE
        prompt_tokens += len(prompt)
        stubs[index].serve(hashes)
        heapq.heappush(pending, (now + rng.expovariate(1 / mean_service_s), i, index))
        max_skew = max(max_skew, max(router.in_flight) - min(router.in_flight))
    wall_s = time.perf_counter() - wall_start

    return {
        "config": {"replicas": args.replicas, "policy": args.policy, "requests": args.requests,
                   "rate": args.rate, "seed": args.seed, "groups": args.groups,
                   "unrelated": args.unrelated, "service_ms": args.service_ms,
                   "replica_cache_blocks": args.replica_cache_blocks,
                   "block_size": BLOCK_SIZE},
        "choose_plus_finished": summary_us(total_ns),
        "choose": summary_us(choose_ns),
        "throughput_rps": args.requests / wall_s,
        "router_only_rps": 1e9 * len(total_ns) / sum(total_ns),
        "routed_to_longest_prefix": on_longest / held_prefix if held_prefix else None,
        "requests_with_a_cached_prefix": held_prefix,
        "prefix_reuse": reused_tokens / prompt_tokens,
        "requests_per_replica": [stub.served for stub in stubs],
        "max_in_flight_skew": max_skew,
        "mean_prompt_tokens": prompt_tokens / args.requests,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policy", choices=ROUTING_POLICIES, default="cache_aware")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rate", type=float, default=1000.0,
                        help="requests per second of wall time; 0: as fast as possible")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--groups", type=int, default=32, help="shared system prompts")
    parser.add_argument("--unrelated", type=float, default=0.2,
                        help="fraction of requests with no shared system prompt")
    parser.add_argument("--service-ms", type=float, default=200.0,
                        help="mean simulated service time (exponential)")
    parser.add_argument("--replica-cache-blocks", type=int, default=1 << 15,
                        help="each stub replica's prefix cache, in blocks of 16 tokens")
    parser.add_argument("--json", metavar="PATH", help="write the results there too")
    args = parser.parse_args()

    result = run(args)
    both, alone = result["choose_plus_finished"], result["choose"]
    print(f"{args.policy}, {args.replicas} replicas, {args.requests} requests at "
          f"{'max' if not args.rate else f'{args.rate:g}/s'} "
          f"(mean prompt {result['mean_prompt_tokens']:.0f} tokens)")
    print(f"  choose+finished  p50 {both['p50_us']:7.1f} µs  p99 {both['p99_us']:7.1f} µs  "
          f"max {both['max_us']:8.1f} µs  mean {both['mean_us']:7.1f} µs")
    print(f"  choose           p50 {alone['p50_us']:7.1f} µs  p99 {alone['p99_us']:7.1f} µs  "
          f"max {alone['max_us']:8.1f} µs  mean {alone['mean_us']:7.1f} µs")
    print(f"  throughput {result['throughput_rps']:.0f} req/s (router alone could do "
          f"{result['router_only_rps']:.0f})")
    longest = result["routed_to_longest_prefix"]
    print(f"  routed to the replica with the longest prefix: "
          f"{'n/a' if longest is None else f'{longest:.1%}'} of "
          f"{result['requests_with_a_cached_prefix']} requests some replica held a prefix of; "
          f"prefix reuse {result['prefix_reuse']:.1%} of prompt tokens")
    print(f"  requests per replica {result['requests_per_replica']}, max in-flight skew "
          f"{result['max_in_flight_skew']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
