"""Grammar processes: the matchers of structured requests sharded over a few helper processes,
so a step's accepts and fills run side by side and outside the core's GIL (docs/ARCHITECTURE.md,
Structured outputs).

Each process holds a GrammarTable for the requests placed on it (on the process with the
fewest) and writes its rows of each step's mask into one shared-memory table that the core
packs into the message. Compiled grammars travel as xgrammar's serialized JSON, once per
process while a request of theirs lives there; both sides count the requests using each, so
a process holds only the grammars of its live requests. Commands travel as msgspec messages on
a socket per process, in order, so a request's grammar is there before the step that needs
it; only a step waits for replies.

The processes run this module (`python -m`), not multiprocessing's spawn: spawn re-imports the
user's main script in the child, so a script that makes an LLM at its top level (which works
without `if __name__ == "__main__"` while the engine runs in its process) would start a
second engine there.
"""

import mmap
import os
import signal
import socket
import subprocess
import sys
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import xgrammar

from echo.sampling_params import StructuredOutputsParams
from echo.structured_output.grammar_table import GrammarTable, GrammarWork, WorkDone
from echo.structured_output.request_grammar import RequestGrammar
from echo.structured_output.whitespace import WhitespaceTokens

# serialized grammars the core keeps to send to the next process that needs them
_SERIALIZED_ENTRIES = 16
# how often a wait for a reply checks that the process is still there
_LIVENESS_S = 1.0


class _Setup(msgspec.Struct, tag=True, array_like=True):
    tokenizer_info: str  # xgrammar's TokenizerInfo, serialized


class _Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    grammar_id: int
    grammar_json: str | None  # None: the process has this grammar already
    params: StructuredOutputsParams
    reasoning_state: str


class _Forget(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class _Run(msgspec.Struct, tag=True, array_like=True):
    work: list[GrammarWork]


_Command = _Setup | _Add | _Forget | _Run


@dataclass
class _Process:
    """The core's record of one grammar process."""
    name: str
    process: subprocess.Popen
    conn: Connection
    grammar_ids: dict[tuple, list[int]] = field(default_factory=dict)  # key: [id, users]
    requests: dict[str, tuple] = field(default_factory=dict)  # request id: its grammar's key
    owed: int = 0  # replies sent for and not read (a step interrupted while it waited)


class GrammarProcessPool:
    def __init__(self, num_processes: int, num_rows: int, num_words: int):
        """num_rows: the most mask rows a step fills (the shared table's height)."""
        size = num_rows * num_words * 4
        self._shm = shared_memory.SharedMemory(create=True, size=size)
        self.rows = np.ndarray((num_rows, num_words), dtype=np.int32, buffer=self._shm.buf)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkDone)
        self._set_up = False
        self._next_grammar_id = 0
        self._serialized: OrderedDict[tuple, str] = OrderedDict()
        self._placed: dict[str, _Process] = {}
        self._processes: list[_Process] = []
        # the modules this process imported from, wherever they came from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            for i in range(num_processes):
                ours, theirs = socket.socketpair()
                with theirs:  # closed here once passed: a dead process then reads as EOF
                    process = subprocess.Popen(
                        [sys.executable, "-m", __name__, str(theirs.fileno()), self._shm.name,
                         str(num_rows), str(num_words)], pass_fds=[theirs.fileno()], env=env)
                self._processes.append(
                    _Process(f"echo-grammar-{i}", process, Connection(ours.detach())))
        except BaseException:
            self.shutdown()
            raise

    def pids(self) -> list[int]:
        return [p.process.pid for p in self._processes]

    def load(self) -> list[tuple[int, int]]:
        """(requests, grammars) each process holds."""
        return [(len(p.requests), len(p.grammar_ids)) for p in self._processes]

    def add(self, request_id: str, compiled: xgrammar.CompiledGrammar,
            params: StructuredOutputsParams, reasoning_state: str) -> None:
        """Place a request whose grammar compiled on the process with the fewest requests."""
        if not self._set_up:  # the tokenizer every grammar is deserialized against
            setup = _Setup(compiled.tokenizer_info.serialize_json())
            for p in self._processes:
                self._send(p, setup)
            self._set_up = True
        p = min(self._processes, key=lambda p: len(p.requests))
        key = params.key
        ids = p.grammar_ids.get(key)
        grammar_json = None
        if ids is None:
            ids = p.grammar_ids[key] = [self._next_grammar_id, 0]
            self._next_grammar_id += 1
            grammar_json = self._serialize(key, compiled)
        ids[1] += 1
        p.requests[request_id] = key
        self._placed[request_id] = p
        self._send(p, _Add(request_id, ids[0], grammar_json, params, reasoning_state))

    def forget(self, request_ids) -> None:
        released = [(p, rid) for rid in request_ids if (p := self._release(rid)) is not None]
        for p, rids in _by_process(released):
            self._send(p, _Forget(rids))

    def run(self, work: list[GrammarWork]) -> WorkDone:
        """Each process does its requests' part; indices and seconds merged (the seconds of
        the slowest process: the wall time the core waits, not the CPU time spent).

        A step interrupted while it waits (Ctrl-C in the LLM's process, which then aborts
        every request and carries on) leaves the processes' replies unread: the next step
        reads them first. The finished requests are released here before the step goes out,
        as each process releases them when it runs the step, so the books agree either way."""
        for p in self._processes:
            while p.owed:
                self._receive(p)
        parts = _by_process([(self._placed[w.request_id], i) for i, w in enumerate(work)])
        for w in work:
            if w.finished:
                self._release(w.request_id)
        for p, indices in parts:
            self._send(p, _Run([work[i] for i in indices]))
            p.owed += 1
        done = WorkDone([], [])
        for p, indices in parts:
            part = self._receive(p)
            done.refused += [indices[j] for j in part.refused]
            done.filled += [indices[j] for j in part.filled]
            done.failed += [(indices[j], error) for j, error in part.failed]
            done.accept_seconds = max(done.accept_seconds, part.accept_seconds)
            done.fill_seconds = max(done.fill_seconds, part.fill_seconds)
        done.filled.sort()  # request order, as the work list has it
        return done

    def shutdown(self) -> None:
        for p in self._processes:
            p.conn.close()  # the process reads EOF and returns
        for p in self._processes:
            try:
                p.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.process.kill()
                p.process.wait()
        self._processes = []
        if self._shm is not None:
            self.rows = None
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def _serialize(self, key: tuple, compiled: xgrammar.CompiledGrammar) -> str:
        text = self._serialized.get(key)
        if text is None:
            text = self._serialized[key] = compiled.serialize_json()
            while len(self._serialized) > _SERIALIZED_ENTRIES:
                self._serialized.popitem(last=False)
        else:
            self._serialized.move_to_end(key)
        return text

    def _release(self, request_id: str) -> "_Process | None":
        """Forget where a request was placed, and its use of its grammar there."""
        p = self._placed.pop(request_id, None)
        if p is not None:
            key = p.requests.pop(request_id)
            ids = p.grammar_ids[key]
            ids[1] -= 1
            if ids[1] == 0:  # the process drops it too (_serve)
                del p.grammar_ids[key]
        return p

    def _send(self, p: _Process, command: _Command) -> None:
        try:
            p.conn.send_bytes(self._encoder.encode(command))
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise self._died(p) from None

    def _receive(self, p: _Process) -> WorkDone:
        try:
            while not p.conn.poll(_LIVENESS_S):
                if p.process.poll() is not None:
                    raise self._died(p)
            reply = self._decoder.decode(p.conn.recv_bytes())
            p.owed -= 1
            return reply
        except (EOFError, OSError):
            raise self._died(p) from None

    @staticmethod
    def _died(p: _Process) -> RuntimeError:
        try:
            p.process.wait(timeout=1)  # for its exit code
        except subprocess.TimeoutExpired:
            pass
        return RuntimeError(f"grammar process {p.name} (pid {p.process.pid}) died "
                            f"(exit code {p.process.returncode})")


def _by_process(pairs: list[tuple[_Process, object]]) -> list[tuple[_Process, list]]:
    """(process, item) pairs gathered by process, in the order processes first appear."""
    groups: dict[int, tuple[_Process, list]] = {}
    for p, item in pairs:
        groups.setdefault(id(p), (p, []))[1].append(item)
    return list(groups.values())


def _serve(conn: Connection, shm_name: str, num_rows: int, num_words: int) -> None:
    """A grammar process: apply commands until the core closes its end of the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the core's to handle
    # mapped by path, not through SharedMemory: that would register the segment with a resource
    # tracker of this process's own, which unlinks it when this process ends
    fd = os.open(f"/dev/shm/{shm_name}", os.O_RDWR)
    try:
        shm = mmap.mmap(fd, num_rows * num_words * 4)
    finally:
        os.close(fd)
    rows = np.ndarray((num_rows, num_words), dtype=np.int32, buffer=shm)
    decoder = msgspec.msgpack.Decoder(_Command)
    encoder = msgspec.msgpack.Encoder()
    table = GrammarTable()
    tokenizer_info = whitespace = None
    compiled: dict[int, list] = {}  # grammar id: [CompiledGrammar, users]
    grammar_of: dict[str, int] = {}  # request id: its grammar id

    def release(request_id: str) -> None:
        table.grammars.pop(request_id, None)
        grammar_id = grammar_of.pop(request_id)
        if grammar_id in compiled:  # not if it never deserialized
            compiled[grammar_id][1] -= 1
            if compiled[grammar_id][1] == 0:
                del compiled[grammar_id]

    try:
        while True:
            try:
                command = decoder.decode(conn.recv_bytes())
            except EOFError:
                return
            if isinstance(command, _Run):
                done = table.run(command.work, rows)
                conn.send_bytes(encoder.encode(done))
                for w in command.work:
                    if w.finished:  # the table forgot it; its grammar's use ends too
                        release(w.request_id)
            elif isinstance(command, _Add):
                grammar_id = command.grammar_id
                future = Future()
                try:
                    if command.grammar_json is not None:
                        compiled[grammar_id] = [xgrammar.CompiledGrammar.deserialize_json(
                            command.grammar_json, tokenizer_info), 0]
                    compiled[grammar_id][1] += 1
                    future.set_result(compiled[grammar_id][0])
                except Exception as e:  # the request fails (WorkDone.failed), the rest go on
                    future.set_exception(RuntimeError(
                        f"the grammar process could not load the grammar: {e!r}"))
                grammar_of[command.request_id] = grammar_id
                grammar = RequestGrammar(future, command.params, command.reasoning_state)
                grammar.resolve(whitespace)
                table.grammars[command.request_id] = grammar
            elif isinstance(command, _Forget):
                for rid in command.request_ids:
                    release(rid)
            elif isinstance(command, _Setup):
                tokenizer_info = xgrammar.TokenizerInfo.deserialize_json(command.tokenizer_info)
                whitespace = WhitespaceTokens.from_vocab(tokenizer_info.decoded_vocab,
                                                         tokenizer_info.vocab_size)
    finally:
        del rows
        shm.close()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
