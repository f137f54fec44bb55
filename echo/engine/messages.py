"""Messages between processes: msgpack-encoded msgspec Structs, no pickle.

frontend -> core: EngineCoreRequest (with a one-byte request-type frame)
core -> frontend: EngineCoreOutputs
rank-0 worker -> core: ModelRunnerOutput
"""

import enum

import msgspec

from echo.sampling_params import SamplingParams


class RequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None


class LogprobsEntry(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of one sampled token: its own, and the top-N alternatives."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    req_ids: list[str] = []
    # per request: [] while its prefill is unfinished, else the one token sampled this step
    sampled_token_ids: list[list[int]] = []
    # per request, parallel to sampled_token_ids; None where no logprobs were asked for
    logprobs: list[LogprobsEntry | None] = []


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0  # cumulative
    num_total_blocks: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] = []
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A call into the core that is not a generation request (stats, reset_prefix_cache)."""

    call_id: int
    method: str


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: object = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility: UtilityResult | None = None
    # set once, when the core hits an error it cannot recover from (then it exits)
    engine_error: str | None = None
