"""What users get back: RequestOutput and CompletionOutput, in the shape vLLM users know."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when unknown (the sampled token outside top-N)
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # what is new since the previous output of this request (streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    # seconds from arrival to first scheduling in the core (the first of its n samples to be
    # scheduled); None until the core has reported it
    queue_time: float | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first; each
    # dict holds the prompt token itself (ranked) and the top-N
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
