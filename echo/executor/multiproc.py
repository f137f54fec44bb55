"""MultiprocExecutor: one worker process per tensor-parallel rank.

Commands go to every worker at once through the shared-memory ring; replies come back over one
ZMQ PULL socket (for steps, from rank 0 only). `execute_model_async` returns as soon as a step
is broadcast and `get_output` waits for the oldest one, so the core can keep two steps in
flight. While waiting, the executor also watches every worker's process sentinel: a worker
that dies is reported within moments as a RuntimeError, never as a hang. A worker that hangs
while alive is caught by the step timeout (envs.step_timeout_s) and the workers are killed.
"""

import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import weakref
from collections import deque

import msgspec
import zmq

from echo import envs
from echo.config import EngineConfig
from echo.core.sched_output import GrammarBitmask, SchedulerOutput
from echo.core.step_results import ModelRunnerOutput
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
from echo.executor.shm_broadcast import PeerDiedError, ShmRingWriter
from echo.executor.worker import WorkerArgs, run_worker

HELLO_INTERVAL_MS = 5  # how often the ring says hello while workers subscribe
DEATH_NOTE_SECONDS = 1.0  # how long to wait for a dying worker's last words
SHUTDOWN_JOIN_SECONDS = 10.0  # for every worker together, before the stragglers are killed
STARTING = "starting the workers"
# the usual reason a worker exits at start-up without a word: spawned processes re-import the
# main module, which, unguarded, starts an engine again
MAIN_GUARD_HINT = ("a script that starts a multi-process engine needs `if __name__ == "
                   "'__main__':`, since worker processes are spawned")


class MultiprocExecutor:
    """Same methods as UniprocExecutor, plus `execute_model_async` and `get_output`."""

    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0,
                 ring_chunks: int = 16, ring_chunk_bytes: int = 1 << 20,
                 step_timeout: float | None = None):
        self.config = config
        self.step_timeout = envs.step_timeout_s() if step_timeout is None else step_timeout
        self.tp_size = config.parallel.tensor_parallel_size
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._pending_steps: deque[int] = deque()  # step ids broadcast, not yet returned
        self._error: str | None = None
        self._workdir = tempfile.mkdtemp(prefix="echo-executor-")  # ipc sockets, dist store
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._reply_address = f"ipc://{self._workdir}/replies.sock"
        self._workers: list[multiprocessing.process.BaseProcess] = []
        workers = self._workers  # the closures below must not hold self (see _release)
        try:
            self._replies.bind(self._reply_address)
            self._ring = ShmRingWriter(self.tp_size, ring_chunks, ring_chunk_bytes,
                                       socket_dir=self._workdir, context=self._context,
                                       is_alive=lambda: all(w.exitcode is None for w in workers))
        except BaseException:  # no finalizer yet: free what exists so far here
            _release(workers, None, self._replies, self._context, self._workdir)
            raise
        # runs once: from shutdown(), when garbage collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, _release, workers, self._ring, self._replies,
                                           self._context, self._workdir)
        try:
            self._spawn_workers(startup_timeout)
            self._poller = zmq.Poller()
            self._poller.register(self._replies, zmq.POLLIN)
            for worker in self._workers:
                self._poller.register(worker.sentinel, zmq.POLLIN)
            self._await_ready(startup_timeout)
        except BaseException:
            self._kill_workers()
            self._finalizer()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    # ---- the UniprocExecutor interface ----------------------------------------------------

    def determine_num_blocks(self) -> int:
        """Every rank measures its own memory; the cache must fit on the tightest one."""
        self._broadcast(DetermineNumBlocks(), "determining the KV cache size")
        replies = self._gather(NumBlocks, "determining the KV cache size")
        return min(reply.num_blocks for reply in replies)

    def init_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitKVCache(num_blocks), "allocating the KV cache")
        self._gather(KVCacheReady, "allocating the KV cache")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_model_async(scheduler_output)
        return self.get_output()

    def shutdown(self) -> None:
        """Stop the workers (killing any that do not exit in time) and remove shm and sockets.
        Safe to call more than once."""
        self._finalizer()

    # ---- two steps in flight --------------------------------------------------------------

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None:
        """Broadcast the step and return at once; `get_output` returns its result later."""
        self._broadcast(ExecuteModel(scheduler_output), f"sending step {scheduler_output.step_id}")
        self._pending_steps.append(scheduler_output.step_id)

    def apply_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        self._broadcast(ApplyGrammarBitmask(bitmask), f"sending step {bitmask.step_id}'s bitmask")

    def get_output(self) -> ModelRunnerOutput:
        """The output of the oldest step in flight; blocks until rank 0 sends it, at most
        `step_timeout` seconds (then the workers are stopped and this raises)."""
        if not self._pending_steps:
            raise RuntimeError("get_output() without a step in flight")
        step_id = self._pending_steps[0]
        what = f"executing step {step_id}"
        reply = self._next_reply(what, self.step_timeout)
        if not isinstance(reply, StepOutput) or reply.output.step_id != step_id:
            self._fail(f"unexpected reply while {what}: {reply!r}")
        self._pending_steps.popleft()
        return reply.output

    # ---- start-up -------------------------------------------------------------------------

    def _spawn_workers(self, startup_timeout: float) -> None:
        spawn = multiprocessing.get_context("spawn")
        for rank in range(self.tp_size):
            args = WorkerArgs(self.config, rank, self._ring.handle, self._reply_address,
                              f"file://{self._workdir}/dist-store", os.getpid(), startup_timeout,
                              self._workdir)
            # daemon: multiprocessing's own exit hook terminates them if all else fails
            worker = spawn.Process(target=run_worker, args=(args,), name=f"echo-worker-{rank}",
                                   daemon=True)
            worker.start()
            self._workers.append(worker)

    def _await_ready(self, timeout: float) -> None:
        what = STARTING
        deadline = time.monotonic() + timeout
        ready: set[int] = set()
        while len(ready) < self.tp_size:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                self._fail(f"timed out after {timeout:g} s while {what} "
                           f"(ready: ranks {sorted(ready)})")
            if not self._ring.all_readers_subscribed():
                self._ring.publish_hello()
                left_ms = min(left_ms, HELLO_INTERVAL_MS)
            reply = self._poll_reply(what, left_ms)
            if reply is None:
                continue
            if not isinstance(reply, WorkerReady):
                self._fail(f"unexpected reply while {what}: {reply!r}")
            ready.add(reply.rank)

    # ---- talking to the workers -----------------------------------------------------------

    def _broadcast(self, command: WorkerCommand, what: str) -> None:
        self._check_usable()
        try:
            self._ring.enqueue(self._encoder.encode(command))
            return
        except PeerDiedError:
            pass  # the ring is full and a worker is gone: report it outside this handler
        self._fail_dead_worker(what)

    def _gather(self, reply_type: type, what: str) -> list:
        """One reply of `reply_type` from every rank, in rank order."""
        if self._pending_steps:
            raise RuntimeError(f"{what}: {len(self._pending_steps)} step(s) still in flight")
        by_rank = {}
        while len(by_rank) < self.tp_size:
            reply = self._next_reply(what, None)
            if not isinstance(reply, reply_type):
                self._fail(f"unexpected reply while {what}: {reply!r}")
            by_rank[reply.rank] = reply
        return [by_rank[rank] for rank in range(self.tp_size)]

    def _next_reply(self, what: str, timeout: float | None) -> WorkerReply:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = -1 if deadline is None else int((deadline - time.monotonic()) * 1000)
            if deadline is not None and wait_ms <= 0:
                self._fail(f"timed out after {timeout:g} s while {what}: a worker is stuck "
                           "(ECHO_STEP_TIMEOUT_S sets the limit); stopped them all")
            reply = self._poll_reply(what, wait_ms)
            if reply is not None:
                return reply

    def _poll_reply(self, what: str, wait_ms: int) -> WorkerReply | None:
        """The next reply within wait_ms (-1: no limit), else None; raises when a worker
        reports a failure or exits."""
        self._check_usable()
        events = dict(self._poller.poll(wait_ms))
        if self._replies in events:
            reply = self._decoder.decode(self._replies.recv())
            if isinstance(reply, WorkerFailed):
                self._fail(f"worker rank {reply.rank} failed while {what}:\n{reply.error}")
            return reply
        if events:  # only sentinels are left: a worker exited
            self._fail_dead_worker(what)
        return None

    # ---- failure --------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)
        if not self._finalizer.alive:
            raise RuntimeError("the executor has been shut down")

    def _fail_dead_worker(self, what: str) -> None:
        # a worker that failed in Python sent its traceback just before exiting: fetch it (a
        # worker killed by a signal had no last words)
        for worker in self._workers:
            # a closed sentinel can precede the exit status by a moment: wait for the status
            if worker.exitcode is None and _sentinel_closed(worker):
                worker.join(timeout=1)
        exited_itself = any(w.exitcode is not None and w.exitcode > 0 for w in self._workers)
        notes = []
        while self._replies.poll(int(DEATH_NOTE_SECONDS * 1000) if exited_itself else 0):
            reply = self._decoder.decode(self._replies.recv())
            if isinstance(reply, WorkerFailed):
                notes.append(f"worker rank {reply.rank} failed while {what}:\n{reply.error}")
        dead = [f"worker rank {rank} (pid {w.pid}) exited with {_describe_exit(w.exitcode)} "
                f"while {what}" for rank, w in enumerate(self._workers) if w.exitcode is not None]
        if what == STARTING and exited_itself and not notes:
            dead.append(f"({MAIN_GUARD_HINT})")
        self._fail("\n".join(notes + dead))

    def _fail(self, message: str) -> None:
        """Remember the error, stop everything, raise. The peers of a failed rank may sit in
        a collective forever: kill them rather than asking them to stop."""
        self._error = message
        self._kill_workers()
        self._finalizer()
        raise RuntimeError(message)

    def _kill_workers(self) -> None:
        for worker in self._workers:
            if worker.exitcode is None:
                worker.kill()
        for worker in self._workers:
            worker.join(timeout=5)


def _sentinel_closed(worker: multiprocessing.process.BaseProcess) -> bool:
    return bool(multiprocessing.connection.wait([worker.sentinel], timeout=0))


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _release(workers: list, ring: ShmRingWriter | None, replies: zmq.Socket,
             context: zmq.Context, workdir: str) -> None:
    """Shut down the workers and free everything; holds no reference to the executor, so it
    can run from weakref.finalize when the executor is collected or the interpreter exits.
    ring is None when building it failed (no workers have started then)."""
    try:
        if any(w.exitcode is None for w in workers):
            try:
                ring.enqueue(msgspec.msgpack.encode(Shutdown()), timeout=2.0)
            except (TimeoutError, PeerDiedError):
                pass  # the workers are killed below
        deadline = time.monotonic() + SHUTDOWN_JOIN_SECONDS
        for worker in workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in workers:
            if worker.exitcode is None:
                worker.kill()  # by pid, through its Process object
                worker.join(timeout=5)
    finally:
        if ring is not None:
            ring.close()
        replies.close(linger=0)
        context.term()
        shutil.rmtree(workdir, ignore_errors=True)
