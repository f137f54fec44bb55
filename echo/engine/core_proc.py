"""The EngineCore process: input thread -> queue -> busy loop -> queue -> output thread.

The core binds both sockets and frontends connect, so a frontend can attach to a core that is
already running at a known address.

The busy loop never touches a socket: two IO threads move msgspec-encoded messages between the
ZMQ sockets and queues, so encoding, decoding and socket waits overlap scheduling and the
workers' GPU work. Frames from the frontend: [request-type byte, msgpack payload].
"""

import os
import queue
import signal
import threading
import time
import traceback

import msgspec
import zmq

from echo.config import EngineConfig
from echo.core.step_results import EngineCoreOutput
from echo.engine.core import EngineCore
from echo.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityRequest,
    UtilityResult,
)
from echo.executor.base import create_executor

# how long the idle busy loop waits for input before checking its parent again
_IDLE_POLL_S = 0.5


class EngineCoreProc:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str):
        self.core = EngineCore(config, executor=create_executor(config, worker_processes=True))
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.ctx = zmq.Context()
        self.stopping = threading.Event()
        self.parent_pid = os.getppid()
        self.threads = [
            threading.Thread(target=self._input_loop, args=(input_address,), daemon=True),
            threading.Thread(target=self._output_loop, args=(output_address,), daemon=True),
        ]
        for t in self.threads:
            t.start()

    # ---- IO threads -----------------------------------------------------------------------

    def _input_loop(self, address: str) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.bind(address)
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        ids_decoder = msgspec.msgpack.Decoder(list[str])
        utility_decoder = msgspec.msgpack.Decoder(UtilityRequest)
        try:
            while not self.stopping.is_set():
                if not sock.poll(100):
                    continue
                kind, payload = sock.recv_multipart(copy=False)
                kind = RequestType(bytes(kind.buffer))
                if kind is RequestType.ADD:
                    self.input_queue.put((kind, add_decoder.decode(payload.buffer)))
                elif kind is RequestType.ABORT:
                    self.input_queue.put((kind, ids_decoder.decode(payload.buffer)))
                elif kind is RequestType.UTILITY:
                    self.input_queue.put((kind, utility_decoder.decode(payload.buffer)))
                else:
                    self.input_queue.put((kind, None))
        except zmq.ContextTerminated:
            pass  # shutdown() gave up waiting for this thread: leave quietly
        finally:
            sock.close(linger=0)

    def _output_loop(self, address: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.bind(address)
        encoder = msgspec.msgpack.Encoder()
        buffer = bytearray()  # reused: encoding allocates nothing per message
        linger_ms = 1000
        try:
            while True:
                outputs = self.output_queue.get()
                if outputs is None:
                    break
                encoder.encode_into(outputs, buffer)
                sock.send(buffer)
        except zmq.ContextTerminated:
            linger_ms = 0  # a frontend that stopped reading: shutdown() stopped waiting for it
        finally:
            sock.close(linger=linger_ms)

    # ---- busy loop ------------------------------------------------------------------------

    def _handle(self, kind: RequestType, payload) -> None:
        core = self.core
        if kind is RequestType.ADD:
            try:
                core.add_request(payload)
            except ValueError as e:  # the request is refused; everyone else carries on
                self.output_queue.put(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    payload.request_id, [], finish_reason="error", error=str(e))]))
        elif kind is RequestType.ABORT:
            finished = core.abort_requests(payload)
            if finished:  # with fresh stats: the freed blocks show at once
                self.output_queue.put(EngineCoreOutputs(
                    outputs=finished, scheduler_stats=core.make_stats()))
        elif kind is RequestType.UTILITY:
            self.output_queue.put(EngineCoreOutputs(utility=self._utility(payload)))
        elif kind is RequestType.SHUTDOWN:
            self.stopping.set()

    def _utility(self, call: UtilityRequest) -> UtilityResult:
        try:
            if call.method == "stats":
                result = msgspec.to_builtins(self.core.make_stats())
            elif call.method == "reset_prefix_cache":
                result = self.core.scheduler.reset_prefix_cache()
            elif call.method == "ping":
                result = "pong"
            else:
                raise ValueError(f"unknown utility method {call.method!r}")
            return UtilityResult(call.call_id, result)
        except Exception as e:
            return UtilityResult(call.call_id, None, error=str(e))

    def run(self) -> None:
        core = self.core
        next_parent_check = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_parent_check:  # also while busy: an orphaned core would run on
                if os.getppid() != self.parent_pid:
                    break  # the frontend died: do not outlive it
                next_parent_check = now + _IDLE_POLL_S
            if not core.has_work():  # idle: block for input
                try:
                    self._handle(*self.input_queue.get(timeout=_IDLE_POLL_S))
                except queue.Empty:
                    continue
            while not self.input_queue.empty():
                self._handle(*self.input_queue.get_nowait())
            if core.has_work():
                outputs = core.step_overlapped()
                if outputs is not None:
                    self.output_queue.put(outputs)
        # NOTE: runs only on the way out, also after an error in a step
        self.shutdown()

    def step_forever(self) -> None:
        try:
            self.run()
        except Exception:
            error = traceback.format_exc()
            self.output_queue.put(EngineCoreOutputs(engine_error=error))
            self.shutdown()
            raise

    def shutdown(self) -> None:
        if self.ctx.closed:
            return
        self.stopping.set()
        self.core.shutdown()
        self.output_queue.put(None)
        for t in self.threads:
            t.join(timeout=2)
        self.ctx.term()


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    ready_pipe, device_ids: tuple[str, ...] | None = None) -> None:
    """Process entry point. Reports ('ready', info) or ('error', text) through ready_pipe.
    device_ids: the GPUs of this core's workers (a data-parallel replica's), None for all."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when to stop
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    if device_ids is not None:  # before any CUDA call; the spawned workers inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(device_ids)
    try:
        proc = EngineCoreProc(config, input_address, output_address)
    except BaseException:
        ready_pipe.send(("error", traceback.format_exc()))
        ready_pipe.close()
        return
    ready_pipe.send(("ready", {"num_gpu_blocks": proc.core.num_blocks,
                               "max_model_len": config.model.max_model_len,
                               "started": time.time()}))
    ready_pipe.close()
    proc.step_forever()
