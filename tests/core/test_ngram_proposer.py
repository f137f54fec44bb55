"""Prompt-lookup drafts on hand-made token sequences."""

import numpy as np
import pytest

from echo.core.ngram_proposer import NgramProposer


def test_the_longest_recent_ngram_proposes_what_followed_it():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix (6, 7) occurs at 1 and 6 (the 3-gram (2, 6, 7) nowhere earlier): the most recent,
    # at 6, was followed by 2, 6, 7
    assert proposer.propose(np.array(tokens)) == [2, 6, 7]
    # a 3-gram match beats a more recent 2-gram one
    assert proposer.propose(np.array([1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3])) == [4, 9, 2]


def test_limits_and_misses():
    proposer = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=2)
    assert proposer.propose(np.array([1, 2, 3, 1, 2])) == [3, 1, 2]  # runs out of tokens
    assert proposer.propose(np.array([1, 2, 3, 1, 2]), limit=1) == [3]
    assert proposer.propose(np.array([1, 2, 3, 1, 2]), limit=0) == []
    assert proposer.propose(np.array([1, 2, 3, 4, 5])) == []  # no bigram recurs
    assert proposer.propose(np.array([7])) == []
    # only the last max_lookback tokens are searched
    far = NgramProposer(2, 2, 2, max_lookback=4)
    assert far.propose(np.array([1, 2, 9, 9, 5, 6, 1, 2])) == []
    assert NgramProposer(2, 2, 2).propose(np.array([1, 2, 9, 9, 5, 6, 1, 2])) == [9, 9]


def test_bad_settings_name_their_field():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, prompt_lookup_min=3, prompt_lookup_max=2)
