"""The best tile config of each swept case in bench_kernels.py JSON files, next to the default.

    python tools/dev/sweep_summary.py decode_sweep.json linear_sweep.json

Sweep rows follow the default row of their case in the file (bench_kernels.py --sweep writes
them in that order), so each is compared with the last default row before it.
"""

import json
import sys


def summarize(rows: list[dict]) -> list[str]:
    lines, case, best = [], None, None

    def flush():
        if case is not None and best is not None:
            gain = case["us"] / best["us"]
            lines.append(f"{case['kernel']:<36} {case['shape']:<30} default {case['us']:8.1f} us"
                         f"  best {best['us']:8.1f} us ({gain:.2f}x, "
                         f"{best['frac_of_ceiling']:.0%})  {best['shape']} {best['note']}")

    for row in rows:
        if "sweep" in row["kernel"]:
            if best is None or row["us"] < best["us"]:
                best = row
        elif "(eager)" not in row["kernel"]:
            flush()
            case, best = row, None
    flush()
    return lines


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as f:
            data = json.load(f)
        print(f"== {path}")
        print("\n".join(summarize(data["rows"] if isinstance(data, dict) else data)))


if __name__ == "__main__":
    main()
