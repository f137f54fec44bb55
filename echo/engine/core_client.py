"""Starting an EngineCore process, and the sockets to one.

`CoreProcess` is what every frontend shares: it spawns the core (which spawns its workers),
waits for its ready message or its traceback, and ends it by PID. `CoreChannel` holds the two
sockets to a core and builds the frames that cross them. The frontends over them are
SyncCoreClient (echo/engine/sync_client.py, behind echo.LLM(engine_process=True)) and
AsyncClient (behind the server).
"""

import itertools
import multiprocessing
import os
import tempfile
import time

import msgspec
import zmq

from echo.config import EngineConfig
from echo.engine.messages import EngineCoreOutputs, EngineCoreRequest, RequestType, UtilityRequest


class EngineDeadError(RuntimeError):
    """The EngineCore process (or one of its workers) is gone; pending requests fail."""


class CoreProcess:
    """A spawned EngineCore process with its ipc addresses. device_ids: the GPUs it and its
    workers see (CUDA_VISIBLE_DEVICES, a data-parallel replica's share), None for all."""

    def __init__(self, config: EngineConfig, device_ids: tuple[str, ...] | None = None,
                 name: str = "EngineCore"):
        from echo.engine.core_proc import run_engine_core

        self.ipc_dir = tempfile.mkdtemp(prefix="echo-")
        self.input_address = f"ipc://{self.ipc_dir}/input"
        self.output_address = f"ipc://{self.ipc_dir}/output"
        mp = multiprocessing.get_context("spawn")
        self._reader, writer = mp.Pipe(duplex=False)
        self.proc = mp.Process(target=run_engine_core, name=name, daemon=False,
                               args=(config, self.input_address, self.output_address, writer,
                                     device_ids))
        self.proc.start()
        writer.close()

    def wait_ready(self, timeout_s: float) -> dict:
        """The core's start-up info; RuntimeError with the core's own message if it failed."""
        status, info = self._read_ready(timeout_s)
        if status != "ready":
            raise RuntimeError(f"EngineCore failed to start:\n{info}")
        return info

    def _read_ready(self, timeout_s: float) -> tuple[str, object]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._reader.poll(0.5):
                try:
                    return self._reader.recv()
                except EOFError:  # the child closed the pipe without a word: it is exiting
                    self.proc.join(5)
                    break
            if not self.proc.is_alive():
                break
        if self.proc.is_alive():
            return "error", f"no ready message within {timeout_s:.0f} s"
        return "error", (f"the process exited with code {self.proc.exitcode} before it was "
                         "ready (a script starting the engine needs `if __name__ == "
                         "'__main__':`, since engine processes are spawned)")

    def exit_error(self) -> "EngineDeadError | None":
        """The error pending requests get once the process has exited, else None."""
        if self.proc.is_alive():
            return None
        return EngineDeadError(f"EngineCore exited with code {self.proc.exitcode}")

    def join(self, timeout_s: float) -> None:
        """Wait for the core to exit, then kill it (by its own PID) if it did not; remove the
        ipc files. Idempotent."""
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        if self.ipc_dir is not None:
            for name in ("input", "output"):
                try:
                    os.unlink(os.path.join(self.ipc_dir, name))
                except FileNotFoundError:
                    pass
            os.rmdir(self.ipc_dir)
            self.ipc_dir = None


class CoreChannel:
    """The two sockets to a core (a CoreProcess, or anything with its input_address and
    output_address: a data-parallel replica) and the frames that cross them, for both clients:
    with a zmq.Context the sockets block, with a zmq.asyncio.Context their calls are awaited."""

    SHUTDOWN_FRAMES = (RequestType.SHUTDOWN.value, b"")

    def __init__(self, ctx: zmq.Context, core):
        self.ctx = ctx
        self.input = ctx.socket(zmq.PUSH)
        self.input.connect(core.input_address)
        self.output = ctx.socket(zmq.PULL)
        self.output.connect(core.output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._call_ids = itertools.count()

    def add_frames(self, request: EngineCoreRequest) -> list[bytes]:
        return [RequestType.ADD.value, self._encoder.encode(request)]

    def abort_frames(self, request_ids: list[str]) -> list[bytes]:
        return [RequestType.ABORT.value, self._encoder.encode(request_ids)]

    def utility_frames(self, method: str) -> tuple[int, list[bytes]]:
        """A new call id, and the frames that ask the core to run `method` under it."""
        call_id = next(self._call_ids)
        return call_id, [RequestType.UTILITY.value,
                         self._encoder.encode(UtilityRequest(call_id, method))]

    def decode(self, message: bytes) -> EngineCoreOutputs:
        return self._decoder.decode(message)

    def close(self) -> None:
        self.input.close(linger=200)
        self.output.close(linger=0)
        self.ctx.term()


def engine_error(outputs: EngineCoreOutputs) -> EngineDeadError | None:
    """The error the core reported before exiting, if this message carries one."""
    if outputs.engine_error:
        return EngineDeadError(f"EngineCore failed:\n{outputs.engine_error}")
    return None
