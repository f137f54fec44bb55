"""Incremental detokenization: text grows token by token, never with a broken UTF-8 fragment.

Decoding a token alone loses the leading-space and byte-fallback context that tokenizers rely
on, so each step decodes a short window of recent tokens twice (with and without the newest
ones) and emits the difference; while the newest tokens end inside a multi-byte character the
decoded text ends in U+FFFD and nothing is emitted until the character completes.
"""

# prompt tokens kept as decoding context so the first output token gets its spacing right
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be empty)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end of a request: whatever is still held back (a trailing partial character)."""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
