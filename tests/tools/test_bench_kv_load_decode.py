"""bench_kv_load_decode on CPU with a tiny model: every history's prefix comes back from the
host tier (exactly its full blocks), and the decode steps are split by whether a load was in
flight."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_kv_load_decode import main  # noqa: E402

from echo.config import EngineConfig  # noqa: E402
from echo.worker.kv_cache import kv_cache_spec  # noqa: E402


def test_histories_load_from_the_host_tier_while_the_decoders_run(tiny_llama, tmp_path,
                                                                   monkeypatch):
    # the bench's 32K-token histories load more blocks than early loads join (128), so their
    # loads wait for their report beside the decoders; these 4-block ones do too under a
    # limit of 2
    monkeypatch.setenv("ECHO_KV_JOINED_LOAD_BLOCKS", "2")
    result = main(["--model", str(tiny_llama), "--load-format", "auto", "--device", "cpu",
                   "--decoders", "2", "--histories", "3", "--history-len", "64",
                   "--suffix-len", "4", "--settle-steps", "5", "--after-steps", "3",
                   "--decoder-prompt-len", "16", "--max-decode-steps", "100",
                   "--json", str(tmp_path / "r.json")])
    # 64 + 4 new tokens: a request reuses at most (68 - 1) // 16 = 4 full blocks, all on the host
    assert result["loaded_blocks"] == 3 * 4
    spec = kv_cache_spec(EngineConfig.create(str(tiny_llama), device="cpu"))
    assert result["loaded_bytes"] == 12 * spec.bytes_per_block()
    assert result["decode_steps_with_loads"] >= 1 and result["decode_steps_without_loads"] >= 2
    assert result["decode_tok_per_s_with_loads"] > 0 and result["transfer_gb_per_s"] > 0
    for key in ("step_ms_with_loads", "step_ms_without_loads"):
        assert result[key]["max"] >= result[key]["p50"] > 0
    assert result["pinned_copy_gb_per_s"] is None  # no GPU
    assert (tmp_path / "r.json").stat().st_size > 0


def test_decode_periods_leave_out_steps_before_an_admission():
    from bench_kv_load_decode import StepClock

    clock = StepClock.__new__(StepClock)
    # (output time, requests, tokens, loading): 2 decoders; at t=4 a history is admitted
    # (3 requests, 18 tokens), launched while step 3's output was awaited
    clock.records = [(0.0, 2, 2, False), (1.0, 2, 2, False), (2.0, 2, 2, True),
                     (3.5, 2, 2, True), (4.0, 3, 18, True), (5.0, 2, 2, True),
                     (6.0, 2, 2, True), (7.0, 2, 2, False)]
    # periods: 0->1 (next 2 alone), 1->2 (next 3 alone); 2->3 is followed by the admission;
    # 3->4 and 4->5 hold it; 5->6 (next 7 alone); 6->7 has no step after it
    assert clock.decode_periods(2) == {False: [1.0], True: [1.0, 1.0]}
