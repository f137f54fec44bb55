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
    """chars: how many whitespace characters each whitespace-only token is (no other token is
    in it); words, keep: the mask words (xgrammar's layout) that hold such tokens, and in each
    the bits of every other token, so the bound touches a few dozen words, not the row."""
    chars: dict[int, int]
    words: np.ndarray
    keep: np.ndarray

    @classmethod
    def from_vocab(cls, decoded_vocab: list[bytes], vocab_size: int) -> "WhitespaceTokens":
        """decoded_vocab: each token's bytes (xgrammar's TokenizerInfo.decoded_vocab); ids up
        to vocab_size past it (the LM head's padding) are no whitespace."""
        chars = {token: len(text) for token, text in enumerate(decoded_vocab[:vocab_size])
                 if text and _WHITESPACE.issuperset(text)}
        clear: dict[int, int] = {}
        for token in chars:
            clear[token // 32] = clear.get(token // 32, 0) | 1 << token % 32
        words = np.array(sorted(clear), dtype=np.int64)
        keep = np.array([~clear[w] & 0xFFFFFFFF for w in sorted(clear)], dtype=np.uint32)
        return cls(chars, words, keep.view(np.int32))

    def run_after(self, run: int, token: int) -> int:
        """The whitespace characters in a row once `token` follows a run of `run`."""
        n = self.chars.get(token, 0)
        return run + n if n else 0

    def limit(self, row: np.ndarray, run: int) -> None:
        """Past the bound, take whitespace-only tokens out of a filled row, in place, unless
        they are all it allows (a grammar that needs whitespace there keeps it)."""
        if run < MAX_JSON_WHITESPACE:
            return
        filled = row[self.words]
        kept = filled & self.keep
        row[self.words] = kept
        # a bit kept among the whitespace words settles it without a pass over the row
        if not kept.any() and not row.any():
            row[self.words] = filled
