"""Messages between the frontend and the core process: msgpack-encoded msgspec Structs, no pickle.

frontend -> core: EngineCoreRequest (with a one-byte request-type frame), UtilityRequest
core -> frontend: EngineCoreOutputs (the step results of echo/core/step_results.py, batched)
"""

import enum

import msgspec

from echo.core.step_results import EngineCoreOutput, SchedulerStats
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
