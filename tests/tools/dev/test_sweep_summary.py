"""sweep_summary: each case's fastest swept config, against the default row before it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "dev"))

from sweep_summary import summarize  # noqa: E402


def row(kernel, shape, us, note=""):
    return {"kernel": kernel, "shape": shape, "us": us, "frac_of_ceiling": 0.5, "note": note}


def test_best_sweep_row_per_case():
    rows = [row("decode", "B=8", 300.0), row("decode (eager)", "B=8", 310.0),
            row("  sweep", "cfg a", 250.0), row("  sweep", "cfg b", 200.0),
            row("decode int8", "B=8", 100.0), row("  sweep", "cfg c", 120.0),
            row("linear", "M=1", 10.0)]  # no sweep rows: not reported
    lines = summarize(rows)
    assert len(lines) == 2
    assert "default    300.0 us" in lines[0] and "best    200.0 us (1.50x" in lines[0]
    assert "cfg b" in lines[0]
    assert "best    120.0 us (0.83x" in lines[1]
