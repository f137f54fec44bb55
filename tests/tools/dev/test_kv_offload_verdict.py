"""kv_offload_verdict: the acceptance points read from hand-written stage files."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "dev"))

from kv_offload_verdict import verdict  # noqa: E402


def test_each_point_against_its_target(tmp_path):
    (tmp_path / "kv_load_decode.json").write_text(json.dumps({
        "decode_ratio_with_loads": 0.963, "transfer_gb_per_s": 51.5,
        "pinned_copy_gb_per_s": {"h2d": 55.4, "d2h": 55.3}}))  # 51.5 / 55.3 = 0.931
    (tmp_path / "kv_load_decode_early.json").write_text(json.dumps({
        "decode_ratio_with_loads": 0.94, "transfer_gb_per_s": 40.0,
        "pinned_copy_gb_per_s": {"h2d": 55.0, "d2h": 55.0}}))  # 0.727
    for name, times, joined in (("limit0_1", 2.45, 0), ("limit128_1", 3.76, 50),
                                ("limit128_2", 2.9, 48)):
        (tmp_path / f"multiturn_tier_{name}.json").write_text(json.dumps({
            "ttft_p50_lower_than_baseline": {"later": times}, "later_ttft_p50_ms": 60.0,
            "loads": 118, "loads_joined": joined}))
    lines = verdict([tmp_path])
    assert lines[0] == ("kv_load_decode: decoders 0.963 (met); copies of pinned 0.931 (met)")
    assert lines[1] == ("kv_load_decode_early: decoders 0.940 (MISSED); copies of pinned "
                        "0.727 (MISSED)")
    assert lines[2] == ("early loads off: later turns' TTFT round 1: 2.45x (MISSED; later p50 "
                        "60.0 ms; joined 0 of 118 loads)")
    assert lines[3] == ("early loads, joined limit 128: later turns' TTFT round 1: 3.76x (met; "
                        "later p50 60.0 ms; joined 50 of 118 loads); round 2: 2.90x (MISSED; "
                        "later p50 60.0 ms; joined 48 of 118 loads)")
