"""The in-process executor: one ModelRunner in the caller's process (TP = 1)."""

from echo.config import EngineConfig
from echo.core.sched_output import GrammarBitmask, SchedulerOutput
from echo.core.step_results import ModelRunnerOutput
from echo.worker.model_runner import ModelRunner


class UniprocExecutor:
    def __init__(self, config: EngineConfig):
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs the multi-process executor")
        self.runner = ModelRunner(config)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None:
        self.runner.launch(scheduler_output)

    def apply_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        self.runner.apply_grammar_bitmask(bitmask)

    def get_output(self) -> ModelRunnerOutput:
        return self.runner.collect()

    def shutdown(self) -> None:
        pass
