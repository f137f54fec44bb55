"""bench_spec on CPU with a tiny model: the run without speculation, then the oracle at
acceptance 0 and 1, each in its own process; the outputs are equal and the JSON has the
fields (acceptance length 1 at p = 0, every draft accepted at p = 1)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_spec import main  # noqa: E402


@pytest.mark.slow  # end to end: make test-slow (make test's budget)
def test_bench_spec_on_a_tiny_model(tiny_llama, tmp_path):
    out = tmp_path / "r.json"
    result = main(["--model", str(tiny_llama), "--load-format", "auto", "--device", "cpu",
                   "--batch-size", "2", "--input-len", "16", "--output-len", "16",
                   "--iters", "1", "--acceptance", "0,1", "--max-model-len", "128",
                   "--num-gpu-blocks-override", "16", "--oracle-path", str(tmp_path / "o.json"),
                   "--token-determined", "--draft-model", str(tiny_llama),
                   "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved == result
    assert isinstance(saved["baseline"]["decode_tok_per_s"], float)
    assert saved["baseline_deterministic"]
    assert saved["outputs_equal"] is True and saved["recording_equals_baseline"] is True
    draft = saved["draft_model"]  # lossless whatever the draft proposes
    assert draft["outputs_equal_baseline"] and draft["num_drafts"] > 0
    assert set(draft["speedup_at_length"]) == {"2", "3", "4"}
    never, always = saved["speculative"]
    assert [never["acceptance"], always["acceptance"]] == [0, 1]
    assert [never["expected_acceptance_length"], always["expected_acceptance_length"]] == [1, 5]
    assert never["acceptance_length"] == 1 and never["num_accepted_tokens"] == 0
    assert always["num_accepted_tokens"] == always["num_draft_tokens"] > 0
    assert 3 < always["acceptance_length"] <= 5  # the last steps draft fewer than 4
    for row in saved["speculative"]:
        assert row["outputs_equal"] and row["mismatched_outputs"] == 0
        # timings only exist here: on two shared CPU cores one iteration is noise
        assert all(isinstance(row[key], float) for key in
                   ("decode_ms_per_step", "decode_tok_per_s", "speedup", "prefill_ms"))
    pairs = json.loads((tmp_path / "o.json").read_text())  # the oracle's file, kept
    assert len(pairs) == 2 and all(len(p) == 16 and len(c) == 16 for p, c in pairs)
    # --token-determined: every next token is a function of the token before it
    follows = {}
    for prompt, continuation in pairs:
        tokens = [prompt[-1], *continuation]
        for a, b in zip(tokens, tokens[1:]):
            assert follows.setdefault(a, b) == b
