"""The worker process: one per tensor-parallel rank, each owning one ModelRunner.

Start-up: join the ring broadcast, set up torch.distributed (NCCL on CUDA, gloo on CPU), build
the ModelRunner, then report ready, or the exception with its traceback, to the executor.
Then loop: read a command from the ring, run it, reply (for steps only rank 0 replies). Any
exception is reported verbatim and ends the worker: a rank that failed mid-step would leave
its peers waiting in a collective, so the executor tears the whole group down.
"""

import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import shared_memory

import msgspec
import zmq

from echo.config import EngineConfig
from echo.executor.messages import (
    ApplyGrammarBitmask,
    DetermineNumBlocks,
    ExecuteModel,
    InitKVCache,
    KVCacheReady,
    NumBlocks,
    Shutdown,
    StepOutput,
    WorkerCommand,
    WorkerFailed,
    WorkerReady,
    WorkerReply,
)
from echo.executor.shm_broadcast import PeerDiedError, RingHandle, ShmRingReader

PARENT_CHECK_SECONDS = 1.0  # how often the watchdog looks for the parent process
REPLY_LINGER_MS = 5000  # how long closing the reply socket may wait to deliver the last reply


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker needs, passed as the spawn argument (pickled inside our tree)."""

    config: EngineConfig
    rank: int
    ring: RingHandle
    reply_address: str  # the executor's PULL socket
    dist_init_method: str  # a file:// or tcp:// rendezvous for torch.distributed
    parent_pid: int
    startup_timeout: float
    executor_dir: str  # the executor's ipc sockets and rendezvous file


def run_worker(args: WorkerArgs) -> None:
    """Process entry point; exits with 0 only after a clean Shutdown."""
    # Ctrl-C reaches the whole process group: the parent decides how to stop, not us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _start_parent_watchdog(args)
    context = zmq.Context()
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, REPLY_LINGER_MS)
    replies.connect(args.reply_address)
    worker = Worker(args, replies, context)
    exit_code = 1
    try:
        worker.start()
        worker.serve()
        exit_code = 0
    except PeerDiedError:
        _remove_orphaned_files(args)  # the parent is gone: nobody to tell, nobody to clean
    except BaseException as e:  # everything goes to the parent, verbatim
        text = "".join(traceback.format_exception(e))
        replies.send(msgspec.msgpack.encode(WorkerFailed(args.rank, text)))
    finally:
        # after a failure a peer may be stuck in a collective: leave the group undestroyed
        worker.close(destroy_group=exit_code == 0)
        replies.close()  # waits up to REPLY_LINGER_MS for the last reply to leave
        context.term()
    # NOTE: everything that matters was closed above; skip the interpreter's teardown, which
    # takes half a second with torch loaded and could hang on a wedged collective
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class Worker:
    def __init__(self, args: WorkerArgs, replies: zmq.Socket, context: zmq.Context):
        self.args = args
        self.rank = args.rank
        self.replies = replies
        self.context = context
        self.encoder = msgspec.msgpack.Encoder()
        self.ring: ShmRingReader | None = None
        self.tp = None  # the TPGroup, once torch.distributed is up
        self.runner = None

    def start(self) -> None:
        parent_pid = self.args.parent_pid
        self.ring = ShmRingReader(self.args.ring, self.rank, context=self.context,
                                  is_alive=lambda: os.getppid() == parent_pid)
        self.ring.wait_for_writer(timeout=self.args.startup_timeout)
        self.runner = self._build_runner()
        self._reply(WorkerReady(self.rank))

    def _build_runner(self):
        # NOTE: torch is imported here, in the worker, so that importing this module (as the
        # executor does, for the entry point) stays cheap in the EngineCore process
        import torch

        from echo.distributed.tp_setup import init_tp_group
        from echo.worker.model_runner import ModelRunner

        config = self.args.config
        device, self.tp = init_tp_group(
            self.rank, config.parallel.tensor_parallel_size, config.device.device,
            self.args.dist_init_method, config.model.arch.hidden_size,
            getattr(torch, config.model.dtype))
        return ModelRunner(config, self.tp, device)

    def serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(WorkerCommand)
        runner = self.runner
        while True:
            if runner.in_flight and not self._next_step_before_device_is_done():
                self._reply_step(runner.collect())
                continue
            # no timeout: an idle engine may wait for requests forever; the liveness check
            # ends the wait when the parent dies
            command = decoder.decode(self.ring.dequeue())
            if isinstance(command, ExecuteModel | ApplyGrammarBitmask):
                # launch the next step before landing the previous one, so its host-side
                # preparation overlaps the device's work; a step with structured requests
                # samples only once its bitmask follows
                if isinstance(command, ExecuteModel):
                    runner.launch(command.scheduler_output)
                else:
                    runner.apply_grammar_bitmask(command.bitmask)
                if len(runner.in_flight) > 1:
                    self._reply_step(runner.collect())
            elif isinstance(command, DetermineNumBlocks):
                self._reply(NumBlocks(self.rank, self.runner.determine_num_blocks()))
            elif isinstance(command, InitKVCache):
                self.runner.init_kv_cache(command.num_blocks)
                self._reply(KVCacheReady(self.rank))
            elif isinstance(command, Shutdown):
                return
            else:  # pragma: no cover - the decoder admits only the union
                raise TypeError(f"unknown worker command {command!r}")

    def _next_step_before_device_is_done(self) -> bool:
        """Wait until the next command arrives (True) or the oldest step in flight finishes
        on the device (False), whichever is first."""
        while not self.ring.has_message():
            if self.runner.oldest_step_done():
                return False
            time.sleep(20e-6)
        return True

    def _reply_step(self, output) -> None:
        if self.rank == 0:
            self._reply(StepOutput(output))

    def _reply(self, message: WorkerReply) -> None:
        self.replies.send(self.encoder.encode(message))

    def close(self, destroy_group: bool) -> None:
        try:
            if self.tp is not None and destroy_group:
                from echo.distributed.tp_setup import destroy_tp_group

                destroy_tp_group(self.tp)
                self.tp = None
        finally:
            if self.ring is not None:
                self.ring.close()  # else context.term() would wait for its socket forever


def _start_parent_watchdog(args: WorkerArgs) -> None:
    """Exit when the parent dies, even while busy in a step or a collective (the ring's
    liveness check covers only the idle wait)."""

    def watch() -> None:
        while os.getppid() == args.parent_pid:
            time.sleep(PARENT_CHECK_SECONDS)
        _remove_orphaned_files(args)
        os._exit(1)

    threading.Thread(target=watch, name="echo-parent-watchdog", daemon=True).start()


def _remove_orphaned_files(args: WorkerArgs) -> None:
    """A parent killed outright leaves its shm segment and ipc folder behind: remove them
    (every worker tries; the first one wins)."""
    try:
        segment = shared_memory.SharedMemory(name=args.ring.shm_name)
        segment.close()
        segment.unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(args.executor_dir, ignore_errors=True)
