"""Incremental detokenization: text grows token by token, never with a broken UTF-8 fragment.

A fast (Rust) tokenizer streams through the tokenizers library's `DecodeStream`, the path vLLM
takes: it keeps the decoding context itself and holds back the tokens of an unfinished
multi-byte character. Other tokenizers take `IncrementalDetokenizer`: decoding a token alone
loses the leading-space and byte-fallback context that tokenizers rely on, so each step decodes
a short window of recent tokens twice (with and without the newest ones) and emits the
difference; while the newest tokens end inside a multi-byte character the decoded text ends in
U+FFFD and nothing is emitted until the character completes. Both emit what is still held back
when the request ends (a trailing partial character, as U+FFFD).
"""

from tokenizers.decoders import DecodeStream

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


class StreamingDetokenizer:
    """The same contract over `DecodeStream`, for fast tokenizers."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        # the prompt's last tokens prime the stream, so the first output token gets its spacing
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        try:
            self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        except TypeError:  # a tokenizers release without ids=: step through them instead
            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in context:
                self.stream.step(self.backend, token_id)
        self.held: list[int] = []  # tokens the stream has not turned into text yet

    def add_tokens(self, new_token_ids: list[int]) -> str:
        text = []
        for token_id in new_token_ids:
            chunk = self.stream.step(self.backend, token_id)
            if chunk is None:
                self.held.append(token_id)
            else:
                self.held.clear()
                text.append(chunk)
        return "".join(text)

    def flush(self) -> str:
        held, self.held = self.held, []
        if not held:
            return ""
        return self.backend.decode(held, skip_special_tokens=self.skip_special_tokens)


Detokenizer = IncrementalDetokenizer | StreamingDetokenizer


def make_detokenizer(tokenizer, prompt_token_ids: list[int],
                     skip_special_tokens: bool = True) -> Detokenizer:
    """DecodeStream where the tokenizer is a fast one, the windowed decoder otherwise."""
    if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "backend_tokenizer"):
        return StreamingDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
