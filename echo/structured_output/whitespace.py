"""The bound on a JSON constraint's free whitespace, applied to the token bitmask.

A JSON grammar with free whitespace lets a model at temperature 1 write blank lines until
max_tokens and never close its object. xgrammar can bound the whitespace in the grammar
(max_whitespace_cnt), but its counted repetition makes every fill of such a grammar 2-5x dearer
(docs/benchmarks.md, Structured outputs). So the grammar stays unbounded and the mask does it:
once a request has written MAX_JSON_WHITESPACE whitespace characters in a row through
whitespace-only tokens, its rows allow only other tokens, as long as the grammar allows any.
The run does not know whether it is inside a string: a string value gets at most about that
many spaces in a row too (a bound the grammar itself did not set; rare in real output).
"""

from dataclasses import dataclass

import numpy as np

from echo.structured_output.grammar_spec import MAX_JSON_WHITESPACE

_WHITESPACE = frozenset(b" \t\n\r")


@dataclass(frozen=True)
class WhitespaceTokens:
    """chars[t]: how many whitespace characters token t is, when it is nothing else (0 for
    every other token); others: a bitmask row (xgrammar's layout) allowing every other token."""
    chars: np.ndarray
    others: np.ndarray

    @classmethod
    def from_vocab(cls, decoded_vocab: list[bytes], vocab_size: int) -> "WhitespaceTokens":
        """decoded_vocab: each token's bytes (xgrammar's TokenizerInfo.decoded_vocab); ids up
        to vocab_size past it (the LM head's padding) are no whitespace."""
        chars = np.zeros(vocab_size, dtype=np.int32)
        for token, text in enumerate(decoded_vocab[:vocab_size]):
            if text and _WHITESPACE.issuperset(text):
                chars[token] = len(text)
        allowed = np.ones(-(-vocab_size // 32) * 32, dtype=bool)
        allowed[:vocab_size] = chars == 0
        others = np.packbits(allowed.reshape(-1, 32), axis=1, bitorder="little")
        return cls(chars, others.view(np.int32).ravel())

    def run_after(self, run: int, token: int) -> int:
        """The whitespace characters in a row once `token` follows a run of `run`."""
        n = int(self.chars[token]) if token < len(self.chars) else 0
        return run + n if n else 0

    def limit(self, row: np.ndarray, run: int) -> None:
        """Past the bound, take whitespace-only tokens out of a filled row, in place, unless
        they are all it allows (a grammar that needs whitespace there keeps it)."""
        if run < MAX_JSON_WHITESPACE:
            return
        kept = row & self.others
        if kept.any():
            row[:] = kept
