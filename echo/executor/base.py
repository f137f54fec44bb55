"""What the engine asks of an executor, and the one place that picks which executor runs."""

from typing import Protocol

from echo.config import EngineConfig
from echo.core.sched_output import GrammarBitmask, SchedulerOutput
from echo.core.step_results import ModelRunnerOutput


class Executor(Protocol):
    def determine_num_blocks(self) -> int:
        """How many KV blocks fit (the smallest over the ranks)."""

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None:
        """Queue one step; get_output() returns the outputs in the order steps were queued."""

    def apply_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        """The token bitmask of a queued step with structured_req_ids: its workers sample
        once it arrives."""

    def get_output(self) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


def create_executor(config: EngineConfig, worker_processes: bool = False) -> Executor:
    """The runner in this process for one rank, unless worker_processes is asked for (the core
    process, whose busy loop must never wait on the device) or there are several ranks: then
    one worker process per rank."""
    if worker_processes or config.parallel.tensor_parallel_size > 1:
        from echo.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from echo.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)
