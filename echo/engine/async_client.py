"""AsyncClient: the asyncio frontend. Tokenizes, talks to EngineCore processes over ZeroMQ,
detokenizes, applies stop strings, and streams outputs per request.

    async with AsyncClient("default") as client:
        async for out in client.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.outputs[0].delta_text, end="")

One asyncio task per core reads its outputs and feeds per-request queues. Leaving a generate()
loop early (break, cancellation) aborts the request in its core.

With data_parallel_size > 1 the client fronts that many replicas (echo.engine.replicas), each
request routed by echo.engine.router. A replica that dies fails its own requests
(EngineDeadError), leaves the rotation and is started again while the others serve; the
client is dead only when no replica serves.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from echo.config import EngineConfig
from echo.core.step_results import SchedulerStats
from echo.engine.core_client import CoreChannel, EngineDeadError, engine_error
from echo.engine.input_processor import InputProcessor, Prompt, load_tokenizer
from echo.engine.messages import EngineCoreOutputs
from echo.engine.output_processor import OutputProcessor
from echo.engine.replicas import Replica, create_replicas
from echo.engine.router import NoReplicaError, Router
from echo.outputs import RequestOutput
from echo.profiling import step_range
from echo.sampling_params import SamplingParams, check_sampling_params

log = logging.getLogger(__name__)

# a replica that fails this many restarts in a row stays down; one that dies within
# STABLE_AFTER_S of starting counts as a failed restart
MAX_RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 1.0
STABLE_AFTER_S = 30.0


class _ReplicaLink:
    """The client's side of one replica: its channel, output task, requests and last stats."""

    def __init__(self, replica: Replica):
        self.replica = replica
        self.channel: CoreChannel | None = None
        self.task: asyncio.Task | None = None
        self.request_ids: set[str] = set()  # the parent ids of the requests routed here
        self.stats = SchedulerStats()
        self.engine_info: dict = {}
        self.state = "starting"  # then serving; restarting or down after it died
        self.connected_at = 0.0
        self.failed_restarts = 0  # in a row

    @property
    def serving(self) -> bool:
        return self.state == "serving"

    def connect(self, info: dict) -> None:
        self.engine_info = info
        self.channel = CoreChannel(zmq.asyncio.Context(), self.replica)
        self.stats = SchedulerStats()  # a restarted core counts from zero
        self.state = "serving"
        self.connected_at = time.monotonic()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


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
        # (replica index, call id) -> the caller's future: call ids count per channel
        self.utility_waiters: dict[tuple[int, int], asyncio.Future] = {}
        self.links: list[_ReplicaLink] = []
        self.request_replica: dict[str, int] = {}  # parent request id -> replica index
        parallel = self.config.parallel
        # one replica needs no routing (and no hashing of every prompt)
        self.router = (Router(parallel.data_parallel_size, parallel.router_policy,
                              self.config.cache.block_size)
                       if parallel.data_parallel_size > 1 else None)
        self.dead_error: str | None = None
        self._none_serving: asyncio.Event | None = None
        self._restarts: set[asyncio.Task] = set()

    @property
    def num_replicas(self) -> int:
        return self.config.parallel.data_parallel_size

    @property
    def proc(self):
        """Replica 0's EngineCore process (multiprocessing.Process) on the mp backend."""
        return getattr(self.links[0].replica, "proc", None) if self.links else None

    @property
    def engine_info(self) -> dict:
        """Replica 0's start-up info (num_gpu_blocks, max_model_len, started)."""
        return self.links[0].engine_info if self.links else {}

    @property
    def replica_stats(self) -> list[SchedulerStats]:
        """Each replica's latest stats, by index (the metrics' engine label)."""
        return [link.stats for link in self.links]

    @property
    def latest_stats(self) -> SchedulerStats:
        return self.links[0].stats if self.links else SchedulerStats()

    def replica_of(self, request_id: str) -> int:
        """The replica serving a request (0 before it is routed)."""
        return self.request_replica.get(request_id, 0)

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        self._none_serving = asyncio.Event()
        self.links = [_ReplicaLink(r) for r in create_replicas(self.config)]
        try:
            for link in self.links:
                link.replica.launch()
            infos = await asyncio.gather(*(
                loop.run_in_executor(None, link.replica.wait_ready, self.startup_timeout_s)
                for link in self.links))
        except BaseException:
            await self.shutdown()
            raise
        for link, info in zip(self.links, infos):
            self._connect(link, info)
        return self

    def _connect(self, link: _ReplicaLink, info: dict) -> None:
        link.connect(info)
        link.task = asyncio.create_task(self._output_loop(link))
        if self.router is not None:
            self.router.set_available(link.replica.index, True)

    async def __aenter__(self) -> "AsyncClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every core (each stops its workers) and wait for them; idempotent."""
        for task in [*self._restarts, *(link.task for link in self.links if link.task)]:
            task.cancel()
        self._restarts.clear()
        loop = asyncio.get_running_loop()
        for link in self.links:
            link.task = None
            if link.channel is not None and link.replica.exit_error() is None:
                await link.channel.input.send_multipart(CoreChannel.SHUTDOWN_FRAMES)
            link.close()
            link.state = "down"
        await asyncio.gather(*(loop.run_in_executor(None, link.replica.stop, timeout_s)
                               for link in self.links))
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
        params = (SamplingParams() if sampling_params is None
                  else check_sampling_params(sampling_params))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self.input_processor.chat_to_ids(prompt)
        text, ids = self.input_processor.tokenize(prompt)
        ids = self.input_processor.truncate(ids, params)
        self.input_processor.validate(ids, params)
        request_id = request_id or uuid.uuid4().hex
        link = self._route(ids)
        try:
            requests = self.output_processor.add_request(request_id, text, ids, params,
                                                         time.time(), priority)
        except BaseException:  # a duplicate id, say: the router must not count it
            if self.router is not None:
                self.router.finished(link.replica.index)
            raise
        out_queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = out_queue
        self.request_replica[request_id] = link.replica.index
        link.request_ids.add(request_id)
        finished = False
        try:
            for request in requests:
                await link.channel.input.send_multipart(link.channel.add_frames(request))
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
            link.request_ids.discard(request_id)
            if self.router is not None:
                self.router.finished(link.replica.index)
            if not finished:  # the caller left early or was cancelled
                await self.abort(request_id)
            self.request_replica.pop(request_id, None)

    def _route(self, prompt_token_ids: list[int]) -> _ReplicaLink:
        if self.router is None:
            return self.links[0]
        try:
            return self.links[self.router.choose(prompt_token_ids)]
        except NoReplicaError as e:
            raise EngineDeadError(str(e)) from None

    async def abort(self, request_id: str) -> None:
        child_ids = self.output_processor.child_ids(request_id)
        self.output_processor.abort(request_id)
        link = self.links[self.request_replica.get(request_id, 0)] if self.links else None
        if child_ids and link is not None and link.serving:
            await link.channel.input.send_multipart(link.channel.abort_frames(child_ids))

    async def wait_until_dead(self) -> str:
        """Return (with the reason) once no replica serves; never returns while one does.
        Raises CancelledError if the client is shut down first."""
        if self._none_serving is None:
            raise RuntimeError("wait_until_dead() before start()")
        await self._none_serving.wait()
        return self.dead_error or "the engine stopped"

    async def health(self) -> bool:
        """Whether at least one replica serves. Asks each whether it died, rather than
        waiting for its output task to notice (up to a second later)."""
        for link in self.links:
            if link.serving and (error := link.replica.exit_error()) is not None:
                link.task.cancel()
                self._replica_died(link, str(error))
        return self.dead_error is None and any(link.serving for link in self.links)

    def replica_states(self) -> list[str]:
        """starting, serving, restarting or down, by replica index (the server's /health)."""
        return [link.state for link in self.links]

    async def stats(self) -> SchedulerStats:
        """Replica 0's stats, fresh from its core (replica_stats has every replica's latest)."""
        result = await self._utility("stats")
        return msgspec.convert(result, SchedulerStats)

    async def reset_prefix_cache(self) -> bool:
        results = [await self._utility("reset_prefix_cache", link) for link in self.links
                   if link.serving]
        return bool(results) and all(results)

    async def _utility(self, method: str, link: _ReplicaLink | None = None,
                       timeout_s: float = 30.0):
        self._check_alive()
        link = link or self.links[0]
        if not link.serving:
            raise EngineDeadError(f"replica {link.replica.index} is not serving")
        call_id, frames = link.channel.utility_frames(method)
        # call ids count per channel: the waiter is keyed by both
        key = (link.replica.index, call_id)
        future = asyncio.get_running_loop().create_future()
        self.utility_waiters[key] = future
        await link.channel.input.send_multipart(frames)
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self.utility_waiters.pop(key, None)

    # ---- the output tasks -----------------------------------------------------------------

    async def _output_loop(self, link: _ReplicaLink) -> None:
        channel, replica = link.channel, link.replica
        try:
            while True:
                if not await channel.output.poll(1000):
                    if (error := replica.exit_error()) is not None:
                        raise error
                    continue
                outputs = channel.decode(await channel.output.recv())
                self._dispatch(outputs, link)
                if (error := engine_error(outputs)) is not None:
                    raise error
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._replica_died(link, str(e))

    def _dispatch(self, outputs: EngineCoreOutputs, link: _ReplicaLink) -> None:
        index = link.replica.index
        if outputs.scheduler_stats is not None:
            link.stats = s = outputs.scheduler_stats
            if self.router is not None:
                self.router.update_stats(index, s.num_running, s.num_waiting, s.kv_cache_usage)
        if outputs.utility is not None:
            future = self.utility_waiters.get((index, outputs.utility.call_id))
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
            link.channel.input.send_multipart(link.channel.abort_frames(to_abort))

    def _replica_died(self, link: _ReplicaLink, message: str) -> None:
        """Fail the replica's requests and take it out of the rotation; start it again while
        another serves (a lone replica's death is the client's)."""
        link.state = "down"
        log.warning("replica %d died: %s", link.replica.index, message)
        if self.router is not None:
            self.router.set_available(link.replica.index, False)
        error = f"replica {link.replica.index}: {message}" if self.num_replicas > 1 else message
        self._fail(link, error)
        if not any(other.serving for other in self.links):
            self.dead_error = error
            self._fail_all(error)
            self._none_serving.set()
            return
        link.state = "restarting"
        task = asyncio.create_task(self._restart(link))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, link: _ReplicaLink) -> None:
        loop = asyncio.get_running_loop()
        link.close()
        if time.monotonic() - link.connected_at < STABLE_AFTER_S:
            link.failed_restarts += 1  # it died soon after starting: that restart failed too
        else:
            link.failed_restarts = 0
        while link.failed_restarts < MAX_RESTART_ATTEMPTS:
            await asyncio.sleep(RESTART_BACKOFF_S * (link.failed_restarts + 1))
            try:
                await loop.run_in_executor(None, link.replica.relaunch)
                info = await loop.run_in_executor(None, link.replica.wait_ready,
                                                  self.startup_timeout_s)
                self._connect(link, info)
            except Exception as e:  # noqa: BLE001 - the replica stays down after the last
                link.failed_restarts += 1
                log.warning("replica %d: restart failed (%d in a row): %s",
                            link.replica.index, link.failed_restarts, e)
                continue
            log.warning("replica %d serves again", link.replica.index)
            return
        link.state = "down"
        await loop.run_in_executor(None, link.replica.stop, 5.0)

    def _fail(self, link: _ReplicaLink, message: str) -> None:
        for request_id in list(link.request_ids):
            out_queue = self.queues.get(request_id)
            if out_queue is not None:
                out_queue.put_nowait(EngineDeadError(message))
        index = link.replica.index
        for (replica, _), future in self.utility_waiters.items():
            if replica == index and not future.done():
                future.set_exception(EngineDeadError(message))

    def _fail_all(self, message: str) -> None:
        for out_queue in self.queues.values():
            out_queue.put_nowait(EngineDeadError(message))
        for future in self.utility_waiters.values():
            if not future.done():
                future.set_exception(EngineDeadError(message))

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if not self.links or all(link.channel is None for link in self.links):
            raise RuntimeError("AsyncClient is not started: use `async with` or await start()")
