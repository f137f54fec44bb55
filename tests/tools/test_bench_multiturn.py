"""bench_multiturn on CPU with a tiny model: histories past a tiny GPU pool come back from the
host tier (its counters move, the GPU hit rate rises over the run without it), and the JSON
and plot are written."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_multiturn import main, ttft_ratios  # noqa: E402

# three conversations of up to ~90 tokens over 8 blocks of 16: they do not fit together
ARGS = ["--load-format", "auto", "--device", "cpu", "--conversations", "3", "--turns", "3",
        "--system-len", "40", "--user-len", "8", "--output-len", "4", "--max-concurrency", "3",
        "--max-num-seqs", "4", "--max-model-len", "256", "--num-gpu-blocks-override", "8"]


@pytest.mark.slow  # end to end: make test-slow (make test's budget)
def test_later_turns_load_their_history_from_the_host_tier(tiny_llama, tmp_path):
    off = main(["--model", str(tiny_llama), *ARGS, "--json", str(tmp_path / "off.json")])
    on = main(["--model", str(tiny_llama), *ARGS, "--kv-offloading-size", "0.01",
               "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
               "--against", str(tmp_path / "off.json")])
    assert off["loaded_blocks"] == 0 and off["host_hit_rate"] == 0
    assert on["stored_blocks"] > 0 and on["loaded_blocks"] > 0 and on["host_hit_rate"] > 0
    assert 0 < on["loads"] <= on["loaded_blocks"] and off["loads"] == 0
    assert on["gpu_hit_rate"] > off["gpu_hit_rate"]  # loaded blocks are reused, not computed
    assert on["load_wait_ms_mean"] > 0 and off["load_wait_ms_mean"] == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [t["turn"] for t in saved["turns"]] == [0, 1, 2]
    assert all(t["ttft_p99_ms"] >= t["ttft_p50_ms"] > 0 for t in saved["turns"])
    # a request's queue time is part of its TTFT, so the p50s keep that order
    assert all(0 <= t["queue_p50_ms"] <= t["ttft_p50_ms"] for t in saved["turns"])
    assert 0 <= on["later_queue_p50_ms"] <= on["later_ttft_p50_ms"]
    assert (tmp_path / "r.png").stat().st_size > 0
    # the later turns (the second half: turns 1 and 2 of 3) pooled, and the ratios to the run
    # without the tier from the two runs' own figures
    assert on["later_turns_from"] == 1 and on["later_ttft_p50_ms"] > 0
    ratios = saved["ttft_p50_lower_than_baseline"]
    assert ratios["later"] == pytest.approx(off["later_ttft_p50_ms"] / on["later_ttft_p50_ms"])
    assert ratios["by_turn"] == pytest.approx(
        [a["ttft_p50_ms"] / b["ttft_p50_ms"] for a, b in zip(off["turns"], on["turns"])])


def test_ttft_ratios_by_turn_and_pooled():
    baseline = {"turns": [{"turn": 0, "ttft_p50_ms": 30.0}, {"turn": 1, "ttft_p50_ms": 240.0}],
                "later_ttft_p50_ms": 250.0}
    run = {"turns": [{"turn": 0, "ttft_p50_ms": 40.0}, {"turn": 1, "ttft_p50_ms": 80.0}],
           "later_ttft_p50_ms": 100.0}
    assert ttft_ratios(baseline, run) == {"by_turn": [0.75, 3.0], "later": 2.5}
    with pytest.raises(ValueError, match="other turns"):
        ttft_ratios(baseline, {**run, "turns": run["turns"][:1]})
