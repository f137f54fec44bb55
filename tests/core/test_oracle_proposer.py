"""The oracle proposer on hand-made continuations: the next k tokens at acceptance 1, one wrong
token at 0, limits and misses, the longest known prompt; the mean accepted run of a seeded
proposer against sum p^i; its file and its speculative_config fields."""

import json
import math

import numpy as np
import pytest

from echo.config import SpeculativeConfig
from echo.core.oracle_proposer import (
    OracleProposer,
    load_continuations,
    save_continuations,
    wrong_token,
)

PROMPT = (1, 2, 3)
CONTINUATION = [10, 11, 12, 13, 14, 15]


def test_acceptance_one_proposes_the_next_k_continuation_tokens():
    oracle = OracleProposer(4, {PROMPT: CONTINUATION}, acceptance=1.0)
    assert oracle.propose([1, 2, 3]) == [10, 11, 12, 13]
    assert oracle.propose([1, 2, 3, 10, 11]) == [12, 13, 14, 15]
    assert oracle.propose(np.array([1, 2, 3, 10])) == [11, 12, 13, 14]  # as NgramProposer's
    assert oracle.propose([1, 2, 3, 10, 11, 12, 13]) == [14, 15]  # the continuation ends
    assert oracle.propose([1, 2, 3] + CONTINUATION) == []  # generated past it


def test_acceptance_zero_proposes_a_wrong_token_then_the_continuation():
    oracle = OracleProposer(4, {PROMPT: CONTINUATION, (7,): [0, 5]}, acceptance=0.0)
    assert oracle.propose([1, 2, 3]) == [9, 11, 12, 13]
    assert oracle.propose([1, 2, 3, 10, 11]) == [11, 13, 14, 15]
    assert oracle.propose([7]) == [1, 5]  # wrong for token 0 too, never negative
    assert all(wrong_token(t) != t and wrong_token(t) >= 0 for t in range(10))


def test_limits_and_misses():
    oracle = OracleProposer(4, {PROMPT: CONTINUATION}, acceptance=1.0)
    assert oracle.propose([1, 2, 3], limit=2) == [10, 11]
    assert oracle.propose([1, 2, 3], limit=0) == []
    assert OracleProposer(2, {PROMPT: CONTINUATION}, 1.0).propose([1, 2, 3], limit=3) == [10, 11]
    assert oracle.propose([1, 2, 4]) == []  # unknown prompt
    assert oracle.propose([1, 2]) == []  # shorter than any prompt
    assert OracleProposer(4, {}, 1.0).propose([1, 2, 3]) == []


def test_the_longest_known_prompt_is_taken():
    oracle = OracleProposer(3, {(1, 2): [4, 5, 6, 7], (1, 2, 3, 9): [8, 8, 8]}, 1.0)
    assert oracle.propose([1, 2, 3, 9]) == [8, 8, 8]
    assert oracle.propose([1, 2, 4]) == [5, 6, 7]  # (1, 2) with one token generated


def accepted_run(drafts: list[int], truth: list[int]) -> int:
    """How many leading drafts greedy verification accepts."""
    n = 0
    while n < len(drafts) and drafts[n] == truth[n]:
        n += 1
    return n


@pytest.mark.parametrize("p", [0.5, 0.77, 0.9])
def test_the_mean_accepted_run_is_the_sum_of_the_powers_of_p(p):
    k, draws = 4, 20_000
    truth = list(range(100, 100 + k))
    oracle = OracleProposer(k, {PROMPT: truth}, acceptance=p, seed=1234)
    runs, per_position = [], [0] * k
    for _ in range(draws):
        drafts = oracle.propose(list(PROMPT))
        run = accepted_run(drafts, truth)
        # right drafts, then one wrong one unless all k are right, then the recorded ones
        assert len(drafts) == k and drafts[:run] == truth[:run]
        assert drafts[run + 1:] == truth[run + 1:]
        runs.append(run)
        for i in range(run):
            per_position[i] += 1
    # P(A >= i) = p^i: E[A] = sum p^i, E[A^2] = sum (2i - 1) p^i
    mean = sum(p ** i for i in range(1, k + 1))
    assert mean == pytest.approx(OracleProposer.expected_accepted(p, k))
    sd = math.sqrt(sum((2 * i - 1) * p ** i for i in range(1, k + 1)) - mean ** 2)
    assert abs(np.mean(runs) - mean) < 5 * sd / math.sqrt(draws)
    for i, count in enumerate(per_position, start=1):  # a binomial count each
        q = p ** i
        assert abs(count - draws * q) < 5 * math.sqrt(draws * q * (1 - q))


def test_a_seed_reproduces_its_drafts():
    def drafts(seed):
        oracle = OracleProposer(4, {PROMPT: CONTINUATION}, acceptance=0.5, seed=seed)
        return [oracle.propose(list(PROMPT)) for _ in range(50)]

    assert drafts(3) == drafts(3) != drafts(4)


def test_bad_settings_name_their_field():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        OracleProposer(0, {}, 0.5)
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="acceptance"):
            OracleProposer(4, {}, bad)


def test_the_file_round_trips_and_bad_files_name_the_field(tmp_path):
    path = tmp_path / "oracle.json"
    save_continuations(path, {PROMPT: CONTINUATION, (5, 6): []})
    assert load_continuations(path) == {PROMPT: CONTINUATION, (5, 6): []}
    for content in ("not json", json.dumps({"a": 1}), json.dumps([[[1, 2]]]),
                    json.dumps([[[], [1]]]), json.dumps([[[1], [-1]]]),
                    json.dumps([[[1], [2]], [[1], [3]]])):
        path.write_text(content)
        with pytest.raises(ValueError, match="speculative_config.oracle_path"):
            load_continuations(path)
    with pytest.raises(ValueError, match="speculative_config.oracle_path"):
        load_continuations(tmp_path / "missing.json")


def test_speculative_config_oracle_fields(tmp_path):
    path = tmp_path / "oracle.json"
    save_continuations(path, {PROMPT: CONTINUATION})
    config = SpeculativeConfig.from_dict({"method": "oracle", "oracle_path": str(path)})
    assert config.oracle_acceptance == 0.75  # the default
    config = SpeculativeConfig(method="oracle", oracle_path=str(path), oracle_acceptance=1)
    assert config.oracle_acceptance == 1
    with pytest.raises(ValueError, match="speculative_config.oracle_path"):
        SpeculativeConfig(method="oracle")  # no file
    with pytest.raises(ValueError, match="speculative_config.oracle_path"):
        SpeculativeConfig(method="oracle", oracle_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="speculative_config.oracle_path"):
        SpeculativeConfig(method="oracle", oracle_path=str(tmp_path))  # a folder
    for bad in (1.5, -0.5, "0.5", False):
        with pytest.raises(ValueError, match="speculative_config.oracle_acceptance"):
            SpeculativeConfig(method="oracle", oracle_path=str(path), oracle_acceptance=bad)
    # the oracle's fields belong to the oracle alone
    with pytest.raises(ValueError, match="speculative_config.oracle_path"):
        SpeculativeConfig(method="ngram", oracle_path=str(path))
    with pytest.raises(ValueError, match="speculative_config.oracle_acceptance"):
        SpeculativeConfig.from_dict({"method": "ngram", "oracle_acceptance": 0.75})
