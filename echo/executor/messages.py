"""Control messages between the executor and its workers (msgpack-encoded, no pickle).

executor -> every worker, through the shm ring: one `WorkerCommand` per message.
worker -> executor, over one ZMQ PUSH/PULL pair: one `WorkerReply` per message; for
`ExecuteModel` only rank 0 replies, since every rank samples the same tokens.
"""

import msgspec

from echo.core.sched_output import GrammarBitmask, SchedulerOutput
from echo.core.step_results import ModelRunnerOutput


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True,
               tag_field="kind"):
    pass


# ---- executor -> workers ------------------------------------------------------------------


class DetermineNumBlocks(_Message, tag="num_blocks"):
    pass


class InitKVCache(_Message, tag="init_kv"):
    num_blocks: int


class ExecuteModel(_Message, tag="execute"):
    scheduler_output: SchedulerOutput


class ApplyGrammarBitmask(_Message, tag="bitmask"):
    """Follows the ExecuteModel of a step with structured_req_ids, before the next step."""

    bitmask: GrammarBitmask


class Shutdown(_Message, tag="shutdown"):
    pass


WorkerCommand = DetermineNumBlocks | InitKVCache | ExecuteModel | ApplyGrammarBitmask | Shutdown


# ---- workers -> executor ------------------------------------------------------------------


class WorkerReady(_Message, tag="ready"):
    rank: int


class WorkerFailed(_Message, tag="failed"):
    rank: int
    error: str  # the exception and its traceback, verbatim


class NumBlocks(_Message, tag="num_blocks"):
    rank: int
    num_blocks: int


class KVCacheReady(_Message, tag="kv_ready"):
    rank: int


class StepOutput(_Message, tag="step"):
    output: ModelRunnerOutput


WorkerReply = WorkerReady | WorkerFailed | NumBlocks | KVCacheReady | StepOutput
