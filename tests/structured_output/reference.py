"""The reference the structured-output tests compare masks with: a fresh xgrammar matcher."""

import numpy as np
import xgrammar


def fresh_mask(compiled: xgrammar.CompiledGrammar, tokens: list[int],
               num_words: int) -> np.ndarray:
    """The next-token mask row of a fresh matcher fed tokens (each must be accepted)."""
    matcher = xgrammar.GrammarMatcher(compiled)
    for token in tokens:
        assert matcher.accept_token(token)
    row = np.zeros((1, num_words), dtype=np.int32)
    matcher.fill_next_token_bitmask(row, 0)
    return row[0]
