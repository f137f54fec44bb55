"""EngineCore: the scheduler and the executor, stepping together.

The offline LLM drives it in its own process; the multi-process engine wraps the same object
in a busy loop with IO threads.
"""

import time

from echo.config import EngineConfig
from echo.core.request import Request
from echo.core.scheduler import Scheduler
from echo.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


class EngineCore:
    def __init__(self, config: EngineConfig, executor=None):
        self.config = config
        if executor is None:
            from echo.executor.uniproc import UniprocExecutor

            executor = UniprocExecutor(config)
        self.executor = executor
        self.num_blocks = executor.determine_num_blocks()
        executor.init_kv_cache(self.num_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks)
        self.eos_token_ids = config.model.arch.eos_token_ids

    def add_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        room = self.config.model.max_model_len - len(request.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, params,
            eos_token_ids=self.eos_token_ids, arrival_time=request.arrival_time or time.time(),
            cache_salt=request.cache_salt, max_tokens=max_tokens))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, update: one step, synchronously."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.time())

    def shutdown(self) -> None:
        self.executor.shutdown()
