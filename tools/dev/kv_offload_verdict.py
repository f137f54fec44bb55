"""#29's three GPU acceptance points, read from the kv-offload stages' JSON files.

    python tools/dev/kv_offload_verdict.py DIR [DIR ...]

DIR holds what `tools/gpu_acceptance.sh kv-offload` (and `kv-offload-repeat`) write:
kv_load_decode*.json from tools/bench_kv_load_decode.py and multiturn_tier_limit{L}_{R}.json
from tools/bench_multiturn.py run with --against that round's run without the tier. Prints, per
configuration, each point against its target: the decoders' rate while loads are in flight (at
least 0.95 of it without), the loads' copies against pinned copies measured in the same run (at
least 80%), and the later turns' TTFT p50 pooled, times lower than the run without the tier (at
least 3), round by round, with how many loads were joined.
"""

import json
import re
import sys
from pathlib import Path

DECODE_RATIO, COPY_SHARE, TTFT_TIMES = 0.95, 0.80, 3.0


def decoders_and_copies(path: Path) -> str:
    run = json.loads(path.read_text())
    ratio = run.get("decode_ratio_with_loads")
    pinned = run.get("pinned_copy_gb_per_s") or {}
    rate = run.get("transfer_gb_per_s")
    share = rate / min(pinned.values()) if rate and pinned else None

    def point(value, target) -> str:
        if value is None:
            return "n/a"
        return f"{value:.3f} ({'met' if value >= target else 'MISSED'})"

    return (f"{path.stem}: decoders {point(ratio, DECODE_RATIO)}; copies of pinned "
            f"{point(share, COPY_SHARE)}")


def later_turns(path: Path) -> tuple[str, int, str]:
    """(configuration, round, its verdict) of one bench_multiturn run with --against."""
    limit, round_ = re.fullmatch(r"multiturn_tier_limit(\d+)_(\d+)", path.stem).groups()
    run = json.loads(path.read_text())
    times = run.get("ttft_p50_lower_than_baseline", {}).get("later")
    config = "early loads off" if limit == "0" else f"early loads, joined limit {limit}"
    if times is None:
        return config, int(round_), "no baseline"
    return config, int(round_), (
        f"{times:.2f}x ({'met' if times >= TTFT_TIMES else 'MISSED'}; later p50 "
        f"{run['later_ttft_p50_ms']:.1f} ms; joined {run.get('loads_joined', 0)} of "
        f"{run.get('loads', 0)} loads)")


def verdict(dirs: list[Path]) -> list[str]:
    lines = [decoders_and_copies(p) for d in dirs for p in sorted(d.glob("kv_load_decode*.json"))]
    by_config: dict[str, list[tuple[int, str]]] = {}
    for d in dirs:
        for path in sorted(d.glob("multiturn_tier_limit*_*.json")):
            config, round_, text = later_turns(path)
            by_config.setdefault(config, []).append((round_, text))
    for config, rounds in by_config.items():
        lines.append(f"{config}: later turns' TTFT " + "; ".join(
            f"round {r}: {text}" for r, text in sorted(rounds)))
    return lines


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for line in verdict([Path(a) for a in argv]):
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
