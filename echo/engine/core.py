"""EngineCore: the scheduler and the executor, stepping together, up to two steps in flight.

The offline LLM drives it in its own process; the multi-process engine wraps the same object
in a busy loop with IO threads.
"""

import gc
import time
from collections import deque

from echo.config import EngineConfig
from echo.core.length_limit import check_kv_cache_holds
from echo.core.request import Request
from echo.core.scheduler import Scheduler
from echo.core.step_results import EngineCoreOutput
from echo.engine.messages import EngineCoreOutputs, EngineCoreRequest
from echo.executor.base import Executor, create_executor
from echo.profiling import step_range


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        self.config = config
        if executor is None:
            executor = create_executor(config)
        self.executor = executor
        try:
            self.num_blocks = executor.determine_num_blocks()
            if config.cache.num_gpu_blocks_override is None:  # an override is deliberate
                check_kv_cache_holds(config.model.max_model_len, config.cache.block_size,
                                     self.num_blocks)
            executor.init_kv_cache(self.num_blocks)
        except BaseException:
            executor.shutdown()
            raise
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks)
        self.eos_token_ids = config.model.arch.eos_token_ids
        # steps sent to the executor whose output has not been processed, oldest first
        self.in_flight: deque = deque()
        self.max_in_flight = 2 if config.scheduler.async_scheduling else 1
        # NOTE: everything alive now (model, caches, tokenizer tables) lives as long as the
        # engine; freezing it keeps the garbage collector from rescanning it every few steps
        # (with many running requests that scan was the step's p99 stall: docs/benchmarks.md,
        # Scheduler CPU cost).
        gc.collect()
        gc.freeze()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_ids=self.eos_token_ids, arrival_time=request.arrival_time or time.time(),
            cache_salt=request.cache_salt, priority=request.priority))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step_overlapped(self) -> EngineCoreOutputs | None:
        """Schedule and launch the next step before waiting for the oldest one in flight, so
        scheduling on the CPU overlaps the workers' GPU work. Returns None when nothing came
        back this call (the pipeline is filling)."""
        scheduled = False
        if len(self.in_flight) < self.max_in_flight and self.scheduler.has_unfinished_requests():
            with step_range("schedule", self.scheduler._step_id):
                scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty or scheduler_output.finished_req_ids:
                self.executor.execute_model_async(scheduler_output)
                self.in_flight.append(scheduler_output)
                scheduled = not scheduler_output.is_empty
        # wait for the oldest step once the pipeline is full, or when nothing new could start
        if not self.in_flight or (scheduled and len(self.in_flight) < self.max_in_flight):
            return None
        scheduler_output = self.in_flight.popleft()
        runner_output = self.executor.get_output()
        with step_range("update", scheduler_output.step_id):
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.time())

    def has_work(self) -> bool:
        return bool(self.in_flight) or self.scheduler.has_unfinished_requests()

    def shutdown(self) -> None:
        self.executor.shutdown()
