"""Limits on every size an HTTP request controls, checked before any work is done for it.

A request may ask for n choices, many prompts, stop strings, messages and long texts; without a
bound each of those is an allocation (or a loop) proportional to what the client sent. Each
limit here has a 400 naming its field. Token counts are checked exactly after tokenizing
(core/length_limit.py); texts are first bounded by characters, since no text longer than
max_model_len times the longest token's text can tokenize into max_model_len tokens.
"""

from dataclasses import dataclass

from echo.core.length_limit import check_request_length

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 1024
# a batch of prompts times n may hold this many max_num_seqs worth of requests
MAX_CHOICES_PER_MAX_NUM_SEQS = 16


@dataclass(frozen=True)
class RequestLimits:
    max_n: int  # choices per prompt: max_num_seqs (vLLM's bound on best_of/n)
    max_choices: int  # prompts x n in one request
    max_prompt_tokens: int  # max_model_len
    max_text_chars: int  # a text this long or longer cannot fit max_model_len tokens

    @staticmethod
    def create(max_num_seqs: int, max_model_len: int,
               longest_token_chars: int) -> "RequestLimits":
        return RequestLimits(
            max_n=max_num_seqs, max_choices=MAX_CHOICES_PER_MAX_NUM_SEQS * max_num_seqs,
            max_prompt_tokens=max_model_len,
            max_text_chars=max_model_len * max(1, longest_token_chars) + 1)

    def check_sampling(self, body) -> None:
        """ValueError 'FIELD: ...' for n, best_of and the stop conditions."""
        for name in ("n", "best_of"):
            value = getattr(body, name)
            if value is not None and value > self.max_n:
                raise ValueError(f"{name}: must be at most {self.max_n} (max_num_seqs), "
                                 f"got {value}")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(f"stop: each string at most {MAX_STOP_STRING_CHARS} characters")
        ids = body.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(ids)}")
        self._check_token_rules(body)

    def _check_token_rules(self, body) -> None:
        """logit_bias and allowed_token_ids: the worker uploads their entries for every step of
        the request, so they are bounded like stop strings (ids are checked against the
        vocabulary by InputProcessor.validate); bad_words likewise."""
        for name, limit in (("logit_bias", MAX_LOGIT_BIAS), ("allowed_token_ids",
                                                            MAX_ALLOWED_TOKEN_IDS)):
            value = getattr(body, name, None) or ()
            if len(value) > limit:
                raise ValueError(f"{name}: at most {limit} entries, got {len(value)}")
        words = getattr(body, "bad_words", None) or []
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
        if any(len(w) > MAX_BAD_WORD_CHARS for w in words):
            raise ValueError(f"bad_words: each word at most {MAX_BAD_WORD_CHARS} characters")

    def check_prompts(self, prompts: list, n: int) -> None:
        """A completion request's prompts: their number, and each one's size before it is
        tokenized or its ids are checked one by one."""
        if len(prompts) * n > self.max_choices:
            raise ValueError(f"prompt: {len(prompts)} prompts x n={n} choices exceed "
                             f"{self.max_choices}")
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_text(prompt, "prompt")
            else:  # token ids: their count, before each id is checked
                check_request_length(len(prompt), self.max_prompt_tokens)

    def check_token_count(self, ids: list, field: str) -> None:
        """Token ids given as such (to /detokenize): no more than max_model_len of them."""
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"{field}: {len(ids)} ids exceed max_model_len "
                             f"{self.max_prompt_tokens}")

    def check_messages(self, messages: list[dict]) -> None:
        # every message adds at least one token through the chat template
        if len(messages) > self.max_prompt_tokens:
            raise ValueError(f"messages: {len(messages)} messages cannot fit in "
                             f"max_model_len {self.max_prompt_tokens} tokens")
        self.check_text("".join(m["content"] for m in messages), "messages")

    def check_text(self, text: str, field: str) -> None:
        if len(text) >= self.max_text_chars:
            raise ValueError(f"{field}: {len(text)} characters cannot fit in max_model_len "
                             f"{self.max_prompt_tokens} tokens")
