"""bench_multiturn on CPU with a tiny model: histories past a tiny GPU pool come back from the
host tier (its counters move, the GPU hit rate rises over the run without it), and the JSON
and plot are written."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_multiturn import main  # noqa: E402

# three conversations of up to ~90 tokens over 8 blocks of 16: they do not fit together
ARGS = ["--load-format", "auto", "--device", "cpu", "--conversations", "3", "--turns", "3",
        "--system-len", "40", "--user-len", "8", "--output-len", "4", "--max-concurrency", "3",
        "--max-num-seqs", "4", "--max-model-len", "256", "--num-gpu-blocks-override", "8"]


@pytest.mark.slow  # end to end: make test-slow (make test's budget)
def test_later_turns_load_their_history_from_the_host_tier(tiny_llama, tmp_path):
    off = main(["--model", str(tiny_llama), *ARGS])
    on = main(["--model", str(tiny_llama), *ARGS, "--kv-offloading-size", "0.01",
               "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
    assert off["loaded_blocks"] == 0 and off["host_hit_rate"] == 0
    assert on["stored_blocks"] > 0 and on["loaded_blocks"] > 0 and on["host_hit_rate"] > 0
    assert on["gpu_hit_rate"] > off["gpu_hit_rate"]  # loaded blocks are reused, not computed
    assert on["load_wait_ms_mean"] > 0 and off["load_wait_ms_mean"] == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [t["turn"] for t in saved["turns"]] == [0, 1, 2]
    assert all(t["ttft_p99_ms"] >= t["ttft_p50_ms"] > 0 for t in saved["turns"])
    assert (tmp_path / "r.png").stat().st_size > 0
