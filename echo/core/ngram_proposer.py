"""Prompt-lookup drafts for speculative decoding (vLLM's method "ngram"): find the longest
recent n-gram that ends the request's tokens earlier in those tokens, and propose what followed
it there. Host work, numpy-vectorized: one comparison over a window of the tokens per n.

Of several earlier occurrences the most recent is taken: the text nearest the end is the
likeliest to repeat next (a model copying from its context copies the latest passage).
"""

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int  # k: at most this many drafts
    prompt_lookup_min: int = 1  # the shortest n-gram that may match
    prompt_lookup_max: int = 4  # the longest, tried first
    # only the last this-many tokens are searched: bounds the host work on long contexts
    max_lookback: int = 4096

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens: must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min, prompt_lookup_max: need 1 <= min <= max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")

    def propose(self, token_ids: np.ndarray, limit: int | None = None) -> list[int]:
        """Drafts to follow token_ids (at most k, and at most limit: the tokens max_tokens or
        max_model_len still allow); [] when no n-gram recurs."""
        k = self.num_speculative_tokens if limit is None else min(limit,
                                                                  self.num_speculative_tokens)
        tokens = np.asarray(token_ids)[-self.max_lookback:]
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            # windows starting before the suffix itself: the n tokens at i..i+n-1
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
