"""echo.LLM: offline batch generation with continuous batching, in the caller's process or
with the engine in its own processes (engine_process=True)."""

import itertools
import time
import weakref
from collections.abc import Callable, Sequence

import msgspec
from tqdm.auto import tqdm

from echo.config import EngineConfig
from echo.core.step_results import SchedulerStats
from echo.engine.core import EngineCore
from echo.engine.input_processor import InputProcessor, Prompt, load_tokenizer
from echo.engine.messages import EngineCoreOutputs, EngineCoreRequest
from echo.engine.output_processor import OutputProcessor
from echo.engine.sync_client import SyncCoreClient
from echo.outputs import RequestOutput
from echo.profiling import step_range
from echo.sampling_params import SamplingParams, check_sampling_params


class LLM:
    """`LLM(model, **engine_args).generate(prompts, sampling_params)`, as with vLLM.

    model: a local Hugging Face folder, a preset name (with load_format="dummy"), or "default"
    (the embedded SmolLM2-135M-Instruct). Engine arguments: see EngineConfig.create.

    engine_process=True runs the EngineCore (scheduler) and the model in their own processes, as
    `echo serve` does, while this process tokenizes and detokenizes: the host work of a step is
    then split three ways (offline figures of both: docs/benchmarks.md, Offline throughput and
    History e20d1fd). With tensor_parallel_size > 1 the ranks always run in worker processes.
    data_parallel_size=N runs N such engines (replicas) and spreads the batch over them, as
    the router of `echo serve --data-parallel-size N` does.
    Processes are ended by `shutdown()`, when the LLM is garbage collected, or at exit.
    """

    def __init__(self, model: str | None = "default", engine_process: bool = False,
                 **engine_args):
        self.config = EngineConfig.create(model, **engine_args)
        self.tokenizer = load_tokenizer(self.config.model)
        self.input_processor = InputProcessor(self.config.model, self.tokenizer)
        # exactly one of the two: the engine in this process, or a client of its process
        self.engine: EngineCore | None = None
        self.client: SyncCoreClient | None = None
        # replicas run in their own processes, as the engine process does
        if engine_process or self.config.parallel.data_parallel_size > 1:
            self.client = SyncCoreClient(self.config)
            core = self.client
            # the core process keeps its own two steps in flight
            self._next_outputs: Callable[[], EngineCoreOutputs | None] = core.get_outputs
        else:
            self.engine = core = EngineCore(self.config)
            # two steps in flight: the next is scheduled while the device runs this one
            self._next_outputs = core.step_overlapped
        # both take the same requests and aborts
        self._add: Callable[[EngineCoreRequest], None] = core.add_request
        self._abort: Callable[[list[str]], object] = core.abort_requests
        self._shutdown = weakref.finalize(self, core.shutdown)
        self._ids = itertools.count()

    @property
    def num_gpu_blocks(self) -> int:
        return (self.engine.num_blocks if self.engine is not None
                else self.client.engine_info["num_gpu_blocks"])

    def shutdown(self) -> None:
        """Stop the engine (and its worker processes); safe to call more than once."""
        self._shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Prompts as text or token-id lists; one SamplingParams for all or one per prompt.
        priority: one per prompt, as vLLM's (lower first; needs scheduling_policy="priority"
        unless all are 0)."""
        # one prompt (text, token ids or vLLM's {"prompt_token_ids": ...} dict) or several
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ValueError("prompts: expected a prompt (text, token ids or {'prompt_token_ids':"
                             f" ...}}) or a list of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = [check_sampling_params(p) for p in sampling_params]
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for "
                                 f"{len(prompts)} prompts")
        else:
            params = [check_sampling_params(sampling_params)] * len(prompts)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: {len(priorities)} given for {len(prompts)} prompts")
        for value in priorities:
            self.config.scheduler.check_priority(value)
        # tokenize and validate everything before anything is queued
        inputs = [self.input_processor.tokenize(p) for p in prompts]
        inputs = [(text, self.input_processor.truncate(ids, p))
                  for (text, ids), p in zip(inputs, params)]
        for (_, ids), p in zip(inputs, params):
            self.input_processor.validate(ids, p)
        return self._run(inputs, params, use_tqdm, priorities)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'}) or a list of them.
        chat_template_kwargs: extra variables for the template (e.g. enable_thinking);
        continue_final_message: leave the last (assistant) message open for the model."""
        if not isinstance(messages, list):
            raise ValueError("messages: expected a list of {'role': ..., 'content': ...} or a "
                             f"list of such lists, got {type(messages).__name__}")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        ids = [self.input_processor.chat_to_ids(
            c, add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(ids, sampling_params, use_tqdm)

    def _run(self, inputs, params, use_tqdm: bool, priorities: list[int]) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer, stream=False)
        order = []
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(inputs), desc="generate", disable=not use_tqdm, unit="req")
        try:
            for (text, ids), p, priority in zip(inputs, params, priorities):
                request_id = str(next(self._ids))
                order.append(request_id)
                for core_request in processor.add_request(request_id, text, ids, p, time.time(),
                                                          priority):
                    self._add(core_request)
            while processor.has_unfinished():
                outputs = self._next_outputs()
                if outputs is None:
                    continue
                with step_range("output-processing"):
                    results, to_abort = processor.process_outputs(outputs.outputs)
                if to_abort:
                    self._abort(to_abort)
                for result in results:
                    if result.finished:
                        finished[result.request_id] = result
                        bar.update(1)
            # the finished requests' blocks on their way to the KV host tier: see them there
            # (the core process does this on its own)
            while self.engine is not None and self.engine.has_work():
                self.engine.step_overlapped()
        except BaseException:
            # leave the engine clean for the next call (e.g. after Ctrl-C)
            self._abort([cid for rid in order for cid in processor.child_ids(rid)])
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in order]

    def stats(self) -> SchedulerStats:
        if self.engine is not None:
            return self.engine.make_stats()
        return msgspec.convert(self.client.utility("stats"), SchedulerStats)
