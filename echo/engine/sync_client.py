"""SyncCoreClient: the blocking frontend of echo.LLM(engine_process=True), as vLLM's LLM has.

The scheduler and the workers' host work run in other processes than the caller's tokenizing
and detokenizing (offline figures of the split processes against one: docs/benchmarks.md,
Offline throughput and History e20d1fd). With data_parallel_size > 1 it fronts that many
replicas (echo.engine.replicas) and spreads the batch over them with echo.engine.router; an
offline batch has no one to serve meanwhile, so a replica's death fails the call
(EngineDeadError) instead of being restarted as the server's AsyncClient does.
"""

import zmq

from echo.config import EngineConfig
from echo.engine.core_client import CoreChannel, EngineDeadError, engine_error
from echo.engine.messages import EngineCoreOutputs, EngineCoreRequest
from echo.engine.replicas import create_replicas
from echo.engine.router import Router


class SyncCoreClient:
    """Blocking sockets to the engine's cores: send requests, aborts and utility calls,
    receive the cores' outputs one message at a time."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0):
        self.replicas = create_replicas(config)
        try:
            for replica in self.replicas:  # they start side by side
                replica.launch()
            infos = [replica.wait_ready(startup_timeout_s) for replica in self.replicas]
        except BaseException:
            for replica in self.replicas:
                replica.stop(10)
            raise
        self.engine_info = infos[0]  # replica 0's: every replica has the same shapes
        self.channels: list[CoreChannel] | None = [
            CoreChannel(zmq.Context(), replica) for replica in self.replicas]
        self.poller = zmq.Poller()
        for channel in self.channels:
            self.poller.register(channel.output, zmq.POLLIN)
        dp = len(self.replicas)
        self.router = Router(dp, config.parallel.router_policy, config.cache.block_size) \
            if dp > 1 else None
        self.request_replica: dict[str, int] = {}  # core request id -> replica index
        # (replica index, outputs) received but not yet returned: several sockets were ready,
        # or a utility call waited for its result
        self.pending: list[tuple[int, EngineCoreOutputs]] = []

    @property
    def core(self):
        """Replica 0's CoreProcess (the mp backend's)."""
        return getattr(self.replicas[0], "core", None)

    def add_request(self, request: EngineCoreRequest) -> None:
        index = 0
        if self.router is not None:
            index = self.router.choose(request.prompt_token_ids, request.cache_salt)
            self.request_replica[request.request_id] = index
        channel = self.channels[index]
        channel.input.send_multipart(channel.add_frames(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            groups.setdefault(self.request_replica.get(request_id, 0), []).append(request_id)
        for index, ids in groups.items():
            self.channels[index].input.send_multipart(self.channels[index].abort_frames(ids))

    def get_outputs(self) -> EngineCoreOutputs:
        """The next message of any core; EngineDeadError if one died or failed."""
        return self._next()[1]

    def _next(self) -> tuple[int, EngineCoreOutputs]:
        if not self.pending:
            self._receive()
        index, outputs = self.pending.pop(0)
        if self.router is not None:
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    routed = self.request_replica.pop(output.request_id, None)
                    if routed is not None:
                        self.router.finished(routed)
        return index, outputs

    def _receive(self) -> None:
        while True:
            ready = dict(self.poller.poll(1000))
            if ready:
                break
            for replica in self.replicas:
                if (error := replica.exit_error()) is not None:
                    raise error
        for index, channel in enumerate(self.channels):
            if channel.output in ready:
                outputs = channel.decode(channel.output.recv())
                if (error := engine_error(outputs)) is not None:
                    raise error
                self.pending.append((index, outputs))

    def utility(self, method: str, replica: int = 0):
        """Call a core method by name (stats, reset_prefix_cache) on one replica and wait for
        its result."""
        channel = self.channels[replica]
        call_id, frames = channel.utility_frames(method)
        channel.input.send_multipart(frames)
        held = []
        try:
            while True:
                index, outputs = self._next()
                # call ids count per channel: only this replica's message answers
                if index == replica and outputs.utility is not None \
                        and outputs.utility.call_id == call_id:
                    if outputs.utility.error:
                        raise RuntimeError(outputs.utility.error)
                    return outputs.utility.result
                held.append((index, outputs))
        finally:
            self.pending = held + self.pending

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every core (each stops its workers) and wait for them; idempotent."""
        if self.channels is not None:
            for replica, channel in zip(self.replicas, self.channels):
                if replica.exit_error() is None:
                    channel.input.send_multipart(CoreChannel.SHUTDOWN_FRAMES)
                channel.close()
            self.channels = None
        for replica in self.replicas:
            replica.stop(timeout_s)


__all__ = ["EngineDeadError", "SyncCoreClient"]
