"""AsyncClient: the asyncio frontend. Tokenizes, talks to an EngineCore process over ZeroMQ,
detokenizes, applies stop strings, and streams outputs per request.

    async with AsyncClient("default") as client:
        async for out in client.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.outputs[0].delta_text, end="")

One asyncio task reads the core's outputs and feeds per-request queues. Leaving a generate()
loop early (break, cancellation) aborts the request in the core.
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from echo.config import EngineConfig
from echo.core.step_results import SchedulerStats
from echo.engine.core_client import CoreChannel, CoreProcess, EngineDeadError, engine_error
from echo.engine.input_processor import InputProcessor, Prompt, load_tokenizer
from echo.engine.messages import EngineCoreOutputs
from echo.engine.output_processor import OutputProcessor
from echo.outputs import RequestOutput
from echo.profiling import step_range
from echo.sampling_params import SamplingParams


class AsyncClient:
    def __init__(self, model: str | None = "default", startup_timeout_s: float = 600.0,
                 chat_template: str | None = None, **engine_args):
        """chat_template: a Jinja template to use instead of the tokenizer's."""
        self.config = EngineConfig.create(model, **engine_args)
        self.tokenizer = load_tokenizer(self.config.model)
        self.input_processor = InputProcessor(self.config.model, self.tokenizer, chat_template)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.startup_timeout_s = startup_timeout_s
        self.queues: dict[str, asyncio.Queue] = {}
        self.utility_waiters: dict[int, asyncio.Future] = {}
        self.latest_stats = SchedulerStats()
        self.engine_info: dict = {}
        self.dead_error: str | None = None
        self.core: CoreProcess | None = None
        self.channel: CoreChannel | None = None
        self.output_task: asyncio.Task | None = None

    @property
    def proc(self):
        """The EngineCore process (multiprocessing.Process), once started."""
        return self.core.proc if self.core is not None else None

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> "AsyncClient":
        self.core = CoreProcess(self.config)
        loop = asyncio.get_running_loop()
        try:
            self.engine_info = await loop.run_in_executor(None, self.core.wait_ready,
                                                          self.startup_timeout_s)
        except BaseException:
            await self.shutdown()
            raise
        self.channel = CoreChannel(zmq.asyncio.Context(), self.core)
        self.output_task = asyncio.create_task(self._output_loop())
        return self

    async def __aenter__(self) -> "AsyncClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (it stops its workers) and wait for it; idempotent."""
        if self.output_task is not None:
            self.output_task.cancel()
            self.output_task = None
        if self.channel is not None:
            if self.proc is not None and self.proc.is_alive():
                await self.channel.input.send_multipart(CoreChannel.SHUTDOWN_FRAMES)
            self.channel.close()
            self.channel = None
        if self.core is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.core.join, timeout_s)
        self._fail_all("the engine was shut down")

    # ---- requests -------------------------------------------------------------------------

    async def generate(self, prompt: Prompt | list[dict],
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream outputs for a prompt (text, token ids, or chat messages). priority: lower is
        served first; other than 0 only with scheduling_policy="priority" (else ValueError)."""
        self._check_alive()
        self.config.scheduler.check_priority(priority)
        params = sampling_params or SamplingParams()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self.input_processor.chat_to_ids(prompt)
        text, ids = self.input_processor.tokenize(prompt)
        self.input_processor.validate(ids, params)
        request_id = request_id or uuid.uuid4().hex
        requests = self.output_processor.add_request(request_id, text, ids, params, time.time(),
                                                     priority)
        out_queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = out_queue
        finished = False
        try:
            for request in requests:
                await self.channel.input.send_multipart(self.channel.add_frames(request))
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error:  # the core refused the request
                    raise ValueError(item.error)
                yield item
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            if not finished:  # the caller left early or was cancelled
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        child_ids = self.output_processor.child_ids(request_id)
        self.output_processor.abort(request_id)
        if child_ids and self.channel is not None:
            await self.channel.input.send_multipart(self.channel.abort_frames(child_ids))

    async def wait_until_dead(self) -> str:
        """Return (with the reason) once the engine has died; never returns while it serves.
        Raises CancelledError if the client is shut down first."""
        if self.output_task is None:
            raise RuntimeError("wait_until_dead() before start()")
        await asyncio.shield(self.output_task)  # the output loop ends only when the engine dies
        return self.dead_error or "the engine stopped"

    async def health(self) -> bool:
        return self.dead_error is None and self.proc is not None and self.proc.is_alive()

    async def stats(self) -> SchedulerStats:
        result = await self._utility("stats")
        return msgspec.convert(result, SchedulerStats)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._utility("reset_prefix_cache"))

    async def _utility(self, method: str, timeout_s: float = 30.0):
        self._check_alive()
        call_id, frames = self.channel.utility_frames(method)
        future = asyncio.get_running_loop().create_future()
        self.utility_waiters[call_id] = future
        await self.channel.input.send_multipart(frames)
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self.utility_waiters.pop(call_id, None)

    # ---- the output task ------------------------------------------------------------------

    async def _output_loop(self) -> None:
        channel = self.channel
        try:
            while True:
                if not await channel.output.poll(1000):
                    if (error := self.core.exit_error()) is not None:
                        raise error
                    continue
                outputs = channel.decode(await channel.output.recv())
                self._dispatch(outputs)
                if (error := engine_error(outputs)) is not None:
                    raise error
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.dead_error = str(e)
            self._fail_all(self.dead_error)

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.latest_stats = outputs.scheduler_stats
        if outputs.utility is not None:
            future = self.utility_waiters.get(outputs.utility.call_id)
            if future is not None and not future.done():
                if outputs.utility.error:
                    future.set_exception(RuntimeError(outputs.utility.error))
                else:
                    future.set_result(outputs.utility.result)
        if not outputs.outputs:
            return
        with step_range("output-processing"):
            results, to_abort = self.output_processor.process_outputs(outputs.outputs)
        for result in results:
            out_queue = self.queues.get(result.request_id)
            if out_queue is not None:
                out_queue.put_nowait(result)
        if to_abort:
            self.channel.input.send_multipart(self.channel.abort_frames(to_abort))

    def _fail_all(self, message: str) -> None:
        for out_queue in self.queues.values():
            out_queue.put_nowait(EngineDeadError(message))
        for future in self.utility_waiters.values():
            if not future.done():
                future.set_exception(EngineDeadError(message))

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self.channel is None:
            raise RuntimeError("AsyncClient is not started: use `async with` or await start()")
