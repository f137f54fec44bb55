"""EngineCore: the scheduler and the executor, stepping together, up to two steps in flight.

The offline LLM drives it in its own process; the multi-process engine wraps the same object
in a busy loop with IO threads.
"""

import gc
import time
from collections import deque

from echo.config import DRAFTING_MODELS, EngineConfig, SpeculativeConfig
from echo.core.length_limit import check_kv_cache_holds
from echo.core.ngram_proposer import NgramProposer
from echo.core.oracle_proposer import OracleProposer, load_continuations
from echo.core.request import Request
from echo.core.sched_output import SchedulerOutput
from echo.core.scheduler import Scheduler
from echo.core.step_results import EngineCoreOutput, SchedulerStats
from echo.engine.input_processor import load_tokenizer
from echo.engine.messages import EngineCoreOutputs, EngineCoreRequest
from echo.executor.base import Executor, create_executor
from echo.profiling import step_range
from echo.structured_output.manager import StructuredOutputManager

# how long a busy loop with nothing to run but grammars compiling waits for one to finish
_COMPILE_WAIT_S = 0.005
# how long a step that only polls KV host-tier copies waits first
_TRANSFER_POLL_S = 0.0005


def make_proposer(spec: SpeculativeConfig, seed: int) -> NgramProposer | OracleProposer | None:
    """The core's drafter of speculative_config's method (the oracle's continuations read
    here); None for a draft model, which the workers run."""
    if spec.method in DRAFTING_MODELS:
        return None
    if spec.method == "oracle":
        return OracleProposer(spec.num_speculative_tokens,
                              load_continuations(spec.oracle_path), spec.oracle_acceptance,
                              seed=seed)
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                         spec.prompt_lookup_max)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        self.config = config
        # before the model loads: an unreadable oracle file fails fast, with nothing to stop
        spec = config.speculative
        proposer = None if spec is None else make_proposer(spec, config.model.seed)
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
        self.num_host_blocks = 0
        if config.cache.kv_offloading_size is not None:
            # here, not at the top: the core process imports torch only for a host tier
            from echo.worker.kv_transfer import num_host_blocks

            self.num_host_blocks = num_host_blocks(config)
        drafter = config.draft_model is not None  # the workers' drafter proposes
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks,
                                   num_host_blocks=self.num_host_blocks,
                                   tensor_parallel_size=config.parallel.tensor_parallel_size,
                                   draft_model_tokens=spec.num_speculative_tokens if drafter
                                   else 0,
                                   spec_max_batch_size=spec and spec.disable_by_batch_size)
        self.eos_token_ids = config.model.arch.eos_token_ids
        # steps sent to the executor whose output has not been processed, oldest first
        self.in_flight: deque = deque()
        # two steps in flight, but one where speculative decoding drafts (_pipeline_depth)
        self.max_in_flight = 2 if config.scheduler.async_scheduling else 1
        self.proposer = proposer
        self.structured = StructuredOutputManager(
            lambda: load_tokenizer(config.model), config.model.arch.vocab_size,
            self.eos_token_ids, config.scheduler.max_num_seqs,
            rows_per_seq=1 + (spec.num_speculative_tokens if spec else 0),
            num_processes=config.scheduler.grammar_processes)
        # a step launched while the one before it was in flight: its bitmask waits for that
        # step's tokens (docs/ARCHITECTURE.md, Structured outputs)
        self._bitmask_due: SchedulerOutput | None = None
        # NOTE: everything alive now (model, caches, tokenizer tables) lives as long as the
        # engine; freezing it keeps the garbage collector from rescanning it every few steps
        # (with many running requests that scan was the step's p99 stall: docs/benchmarks.md,
        # Scheduler CPU cost).
        gc.collect()
        gc.freeze()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError if it is refused (the others carry on)."""
        core_request = Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_ids=self.eos_token_ids, arrival_time=request.arrival_time or time.time(),
            cache_salt=request.cache_salt, priority=request.priority)
        self.scheduler.add_request(core_request)
        if request.sampling_params.structured_outputs is not None:
            try:
                self.structured.add(core_request)
            except ValueError:
                self.scheduler.abort_requests([request.request_id])
                raise

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        self.structured.forget(request_ids)
        return self.scheduler.abort_requests(request_ids)

    def _fail(self, failures: list[tuple[str, str]]) -> list[EngineCoreOutput]:
        """Finish requests with an error (a grammar that failed), as refusals are reported."""
        return [output for rid, error in failures for output in self._abort(rid, error)]

    def _abort(self, request_id: str, error: str) -> list[EngineCoreOutput]:
        self.structured.forget([request_id])
        outputs = self.scheduler.abort_requests([request_id])
        for output in outputs:
            output.finish_reason, output.error = "error", error
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step_overlapped(self) -> EngineCoreOutputs | None:
        """Schedule and launch the next step before waiting for the oldest one in flight, so
        scheduling on the CPU overlaps the workers' GPU work. Returns None when nothing came
        back this call (the pipeline is filling)."""
        structured = self.structured
        failed = self._fail(structured.poll()) if structured.compiling else []
        kv = self.scheduler.kv
        scheduled = False
        if len(self.in_flight) < self._pipeline_depth() and (
                self.scheduler.has_unfinished_requests() or kv.transfers_pending):
            scheduled = self._launch_next()
        # wait for the oldest step once the pipeline is full, or when nothing new could start
        if not self.in_flight or (scheduled and len(self.in_flight) < self._pipeline_depth()):
            if not self.in_flight and structured.compiling and not failed:
                structured.wait_for_compiles(_COMPILE_WAIT_S)  # nothing else to do
            return EngineCoreOutputs(outputs=failed) if failed else None
        scheduler_output = self.in_flight.popleft()
        runner_output = self.executor.get_output()
        with step_range("update", scheduler_output.step_id):
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            refused = []
            due, self._bitmask_due = self._bitmask_due, None
            if due is not None:  # the launched step's mask, filled as its matchers advance
                with step_range("bitmask", due.step_id):
                    refused, mask = structured.accept_and_fill(
                        outputs, due.step_id, due.structured_req_ids,
                        due.scheduled_spec_decode_tokens)
                    self.executor.apply_grammar_bitmask(mask)
            elif structured.grammars:
                refused = structured.accept(outputs)
            if refused:
                self._refuse(outputs, refused)
            if self.proposer is not None:
                self.scheduler.propose_drafts(self.proposer.propose)
        if (self.max_in_flight > 1 and not self.in_flight and self._pipeline_depth() == 1
                and self.scheduler.has_unfinished_requests()):
            # drafting holds one step in flight: launch the next (its drafts are in) before
            # the outputs go back, so their return and processing overlap it
            self._launch_next()
        if (not (failed or outputs) and scheduler_output.is_empty
                and (scheduler_output.has_kv_transfers or self.scheduler.kv.transfers_pending)):
            return None  # a step that only carried or polled copies: nothing to tell
        return EngineCoreOutputs(outputs=failed + outputs,
                                 scheduler_stats=self.make_stats(),
                                 timestamp=time.time())

    def _launch_next(self) -> bool:
        """Schedule a step and send it to the workers; whether it computes anything."""
        kv = self.scheduler.kv
        with step_range("schedule", self.scheduler._step_id):
            scheduler_output = self.scheduler.schedule()
        # a step with nothing to compute still carries forgotten requests and KV copies, and
        # polls the copies in flight (the workers report them done with an output)
        if (scheduler_output.is_empty and not scheduler_output.finished_req_ids
                and not scheduler_output.has_kv_transfers and not kv.transfers_pending):
            return False
        polling = not (scheduler_output.finished_req_ids or scheduler_output.has_kv_transfers)
        if scheduler_output.is_empty and polling:
            time.sleep(_TRANSFER_POLL_S)  # only waiting on copies: do not spin
        self.executor.execute_model_async(scheduler_output)
        if scheduler_output.structured_req_ids:
            if self.in_flight:  # the step before it still owes tokens
                self._bitmask_due = scheduler_output
            else:
                self._send_bitmask(scheduler_output)
        self.in_flight.append(scheduler_output)
        return not scheduler_output.is_empty

    def _pipeline_depth(self) -> int:
        """How many steps may be in flight. With speculative decoding a step's drafts come from
        the tokens of the step before, on the host, and the runner verifies them landed: one,
        while anyone drafts (docs/ARCHITECTURE.md, Speculative decoding). Above
        disable_by_batch_size running requests nobody drafts, and two steps overlap again once
        no step in flight and no request holds drafts."""
        if self.config.speculative is None or self.max_in_flight == 1:
            return self.max_in_flight
        if (not self.scheduler.drafts_paused()
                or any(step.scheduled_spec_decode_tokens for step in self.in_flight)
                or any(request.spec_token_ids for request in self.scheduler.running)):
            return 1
        return self.max_in_flight

    def _send_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        with step_range("bitmask", scheduler_output.step_id):
            self.executor.apply_grammar_bitmask(self.structured.bitmask(
                scheduler_output.step_id, scheduler_output.structured_req_ids,
                scheduler_output.scheduled_spec_decode_tokens))

    def _refuse(self, outputs: list[EngineCoreOutput], refused: list[tuple[str, str]]) -> None:
        """Finish, with an error, requests whose sampled token their grammar refused."""
        errors = dict(refused)
        for output in outputs:
            error = errors.get(output.request_id)
            if error is not None and output.finish_reason is None:
                self._abort(output.request_id, error)  # this output, with its token, ends it
                output.finish_reason, output.error = "error", error

    def make_stats(self) -> SchedulerStats:
        """The scheduler's stats with the core's grammar work added."""
        stats = self.scheduler.make_stats()
        structured = self.structured
        stats.grammar_accept_seconds = structured.accept_seconds
        stats.grammar_fill_seconds = structured.fill_seconds
        stats.grammar_bitmask_steps = structured.bitmask_steps
        return stats

    def has_work(self) -> bool:
        return (bool(self.in_flight) or self.scheduler.has_unfinished_requests()
                or self.scheduler.kv.transfers_pending)

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
        # what __init__ froze (model, caches) can be collected again once this engine is gone:
        # frozen, a process that starts engines one after another (tests, notebooks) kept them
        gc.unfreeze()
