"""A request as the EngineCore's scheduler sees it: token ids and how far they are computed."""

import enum
import time

from echo.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # everything from here on is finished
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# RequestStatus -> the finish_reason users see (OpenAI's words)
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.priority = priority  # lower is served first (scheduling_policy="priority" only)
        self.max_tokens = sampling_params.max_tokens  # None: up to max_model_len
        # prompt + output length at which it stops for length; set by the scheduler on admission
        self.token_limit = 0
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling; -1 = not yet
        # tokens scheduled whose sampled value has not come back yet (async scheduling)
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        # structured outputs: the engine's grammar state (RequestGrammar); the scheduler only
        # reads its `ready` (admit once compiled) and reports the request when it samples
        self.grammar = None
        # speculative decoding: drafts proposed for its next step (consumed when scheduled)
        self.spec_token_ids: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
