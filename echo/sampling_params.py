"""SamplingParams: how one request's tokens are chosen and when it stops.

A msgspec Struct so it crosses process boundaries as-is; validated on construction with errors
that name the field, so bad input fails before any work is queued.
"""

import math

import msgspec

_GREEDY_EPS = 1e-5


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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

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
        _require(self.seed is None or 0 <= self.seed < 2**63, "seed",
                 f"must be in [0, 2**63), got {self.seed}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}: {message}")
