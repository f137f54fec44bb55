"""SamplingParams: how one request's tokens are chosen and when it stops.

A msgspec Struct so it crosses process boundaries as-is; validated on construction with errors
that name the field, so bad input fails before any work is queued.
"""

import json
import math

import msgspec

_GREEDY_EPS = 1e-5
# the kinds of constraint StructuredOutputsParams takes; exactly one per request
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, array_like=True):
    """vLLM's structured outputs: the output must follow one of these (exactly one is set).

    json: a JSON schema (a dict, or its JSON text); regex: a regular expression the whole
    output matches; choice: the output is one of these strings; grammar: an EBNF grammar
    (xgrammar's dialect, GBNF-like, root rule `root`); json_object: any JSON object;
    structural_tag: xgrammar's structural tag, as JSON text. Grammars are checked by the
    frontend (echo/structured_output/grammar_spec.py) and compiled by the engine."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # JSON without free whitespace between tokens (vLLM's disable_any_whitespace)
    disable_any_whitespace: bool = False
    # filled by the server from its reasoning parser: the token ids that open and close the
    # reasoning; the constraint applies from the token after the close
    reasoning_token_ids: list[int] | None = None

    def __post_init__(self):
        if isinstance(self.json, dict):  # one text per schema: the grammar cache's key
            self.json = json.dumps(self.json, ensure_ascii=False, separators=(",", ":"))
        if self.json_object is False:
            self.json_object = None
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) is not None]
        _require(len(given) == 1, "structured_outputs",
                 f"exactly one of {', '.join(STRUCTURED_KINDS)} must be given, got "
                 f"{', '.join(given) if given else 'none'}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and value.strip()),
                     f"structured_outputs.{name}", "must be a non-empty string")
        if self.choice is not None:
            _require(isinstance(self.choice, list) and self.choice and all(
                isinstance(c, str) and c for c in self.choice), "structured_outputs.choice",
                "must be a non-empty list of non-empty strings")
        if self.reasoning_token_ids is not None:
            _require(len(self.reasoning_token_ids) == 2 and all(
                _is_id(t) for t in self.reasoning_token_ids),
                "structured_outputs.reasoning_token_ids", "must be [start id, end id]")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) is not None)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (with the tokenizer)."""
        kind = self.kind
        value = getattr(self, kind)
        return (kind, tuple(value) if kind == "choice" else value,
                self.disable_any_whitespace)


class SamplingParams(msgspec.Struct, omit_defaults=True, array_like=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no limit
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per token (0: only the sampled one)
    # vLLM's: per prompt token after the first, its logprob and the top-N (0: only its own)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token rules, applied to the logits before penalties, temperature and top-k/top-p/min-p;
    # reported logprobs stay those of the raw logits, as vLLM's (logprobs_mode=raw_logprobs)
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words that may not be generated
    # bad_words as token-id sequences, filled in the frontend (update_from_tokenizer): the
    # last token of each is banned when the output so far ends with the ones before it
    bad_words_token_ids: list[list[int]] | None = None
    # the output follows a JSON schema, regex, choice or grammar (vLLM's structured outputs)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: keep only the prompt's last k tokens (left truncation; -1: max_model_len), done
    # by the frontend before the length checks (InputProcessor.truncate)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # JSON parsers accept NaN and 1e999
            value = getattr(self, name)
            _require(math.isfinite(value), name, f"must be a finite number, got {value}")
        _require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "top_k", f"must be -1 (no limit) or >= 0, got {self.top_k}")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
                 f"must be >= 1, got {self.max_tokens}")
        _require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty",
                 f"must be in [-2, 2], got {self.presence_penalty}")
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
                 f"must be in [-2, 2], got {self.frequency_penalty}")
        _require(self.repetition_penalty > 0, "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty}")
        _require(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
                 f"must be in [0, 20], got {self.logprobs}")
        _require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                 "prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        _require(self.seed is None or 0 <= self.seed < 2**63, "seed",
                 f"must be in [0, 2**63), got {self.seed}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 "must be non-empty strings")
        _require(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
                 or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
                 f"must be -1 (max_model_len) or >= 1, got {self.truncate_prompt_tokens}")
        self._check_token_rules()
        _require(self.structured_outputs is None or isinstance(
            self.structured_outputs, StructuredOutputsParams), "structured_outputs",
            "must be a StructuredOutputsParams")

    def _check_token_rules(self) -> None:
        if self.logit_bias is not None:
            _require(isinstance(self.logit_bias, dict), "logit_bias",
                     "must map token ids to biases")
            for token, bias in self.logit_bias.items():
                _require(_is_id(token), "logit_bias", f"keys must be token ids, got {token!r}")
                _require(_is_number(bias) and -100 <= bias <= 100, "logit_bias",
                         f"biases must be in [-100, 100], got {bias!r} for token {token}")
        if self.allowed_token_ids is not None:
            _require(isinstance(self.allowed_token_ids, list) and self.allowed_token_ids,
                     "allowed_token_ids", "must be a non-empty list of token ids")
            _require(all(_is_id(t) for t in self.allowed_token_ids), "allowed_token_ids",
                     "must be token ids (integers >= 0)")
        if self.bad_words is not None:
            _require(isinstance(self.bad_words, list) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
                "must be a list of non-blank strings")
        if self.bad_words_token_ids is not None:
            _require(isinstance(self.bad_words_token_ids, list) and all(
                isinstance(ids, list) and ids and all(_is_id(t) for t in ids)
                for ids in self.bad_words_token_ids), "bad_words_token_ids",
                "must be non-empty lists of token ids")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Resolve bad_words into bad_words_token_ids as vLLM does: each word is tokenized
        as given (leading spaces stripped) and, where it tokenizes differently into as many
        tokens, with one leading space too, so it is banned mid-text as well as at the
        start. Called by the frontend on every request (InputProcessor.validate)."""
        if not self.bad_words:
            return
        _require(tokenizer is not None, "bad_words",
                 "this model has no tokenizer to turn them into tokens")
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            _require(bool(plain), "bad_words", f"{word!r} tokenizes to no tokens")
            sequences.append(plain)
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        self.bad_words_token_ids = sequences

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id of the stop ids and token rules is in the model's vocabulary."""
        def check(name: str, ids) -> None:
            bad = sorted({t for t in ids if not 0 <= t < vocab_size})
            _require(not bad, name, f"token ids must be in [0, {vocab_size}), got {bad[:8]}")

        if self.stop_token_ids:
            check("stop_token_ids", self.stop_token_ids)
        if self.logit_bias:  # distinct ids in the vocabulary: at most vocab_size of them
            check("logit_bias", self.logit_bias)
        if self.allowed_token_ids:
            check("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words_token_ids:
            check("bad_words" if self.bad_words else "bad_words_token_ids",
                  (t for ids in self.bad_words_token_ids for t in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def has_token_rules(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def check_sampling_params(value) -> SamplingParams:
    """value, if it is a SamplingParams: the Python APIs' check of what they were given (a dict
    of its fields, say, would otherwise fail deep inside as an AttributeError)."""
    if not isinstance(value, SamplingParams):
        raise ValueError(f"sampling_params: expected a SamplingParams, got {type(value).__name__}")
    return value


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}: {message}")
