"""A shared-memory ring buffer that broadcasts byte messages from one writer to N readers.

One `SharedMemory` segment holds a fixed number of fixed-size chunks:

    [subscribed flag per reader] [per chunk: written flag, read flag per reader] [chunks]
    chunk = [u64 payload length, or OVERSIZE] [payload]

writer: wait until the chunk is free (never written, or read by every reader), then
        written=0, read flags=0, payload, written=1, publish a wake-up on the ZMQ PUB socket.
reader: wait until its read flag is 0 and the written flag is 1, copy, set its read flag.

A message larger than a chunk travels on the PUB socket; its chunk only says "look there".
Readers spin for a few tens of microseconds, then block on the SUB socket, so an idle reader
uses no CPU. Blocking waits take a timeout and a liveness callback, so a dead peer raises
instead of hanging anyone.

NOTE: readers may live in other processes only when those were started from the writer's
process (multiprocessing spawn/fork): they then share its resource tracker, whose bookkeeping
keeps the segment alive until the writer unlinks it.

A writer killed outright, with its resource tracker (a Ray actor's process tree, an OOM kill),
unlinks nothing. Segments and sockets are named after the writer's pid, so the next writer
sweeps those whose writer is gone (sweep_orphaned_rings).
"""

import os
import secrets
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing import shared_memory

import msgspec
import zmq

LENGTH = struct.Struct("<Q")
OVERSIZE = 2**64 - 1  # length field of a chunk whose payload went over the socket
# first frame of every message on the PUB socket
HELLO, WAKE, DATA = b"H", b"W", b"D"
SPIN_SECONDS = 50e-6  # how long a waiting reader spins before it blocks on the socket
LIVENESS_INTERVAL = 0.2  # seconds between liveness checks while blocked
DRAIN_EVERY = 64  # reads between drains of wake-ups a busy (never blocking) reader left queued


class PeerDiedError(RuntimeError):
    """The liveness callback said the other side is gone."""


class RingHandle(msgspec.Struct, frozen=True):
    """What a reader needs to attach: travels to worker processes as a start argument."""

    shm_name: str
    num_readers: int
    num_chunks: int
    chunk_bytes: int
    pub_address: str


class _Layout:
    def __init__(self, handle: RingHandle):
        self.num_readers = handle.num_readers
        self.num_chunks = handle.num_chunks
        self.chunk_bytes = handle.chunk_bytes
        self.capacity = handle.chunk_bytes - LENGTH.size  # payload bytes that fit in a chunk
        self.meta_stride = 1 + handle.num_readers
        self.meta_start = handle.num_readers  # after the subscribed flags
        meta_end = self.meta_start + self.meta_stride * handle.num_chunks
        self.chunks_start = -(-meta_end // 64) * 64  # cache-line aligned payloads
        self.total_bytes = self.chunks_start + handle.num_chunks * handle.chunk_bytes

    def meta(self, chunk: int) -> int:
        """Offset of the chunk's written flag; its read flags follow."""
        return self.meta_start + chunk * self.meta_stride

    def chunk(self, chunk: int) -> int:
        return self.chunks_start + chunk * self.chunk_bytes


class _Waiter:
    """Deadline and rate-limited liveness checks for one blocking wait."""

    def __init__(self, timeout: float | None, is_alive: Callable[[], bool] | None, what: str):
        now = time.monotonic()
        self.deadline = None if timeout is None else now + timeout
        self.is_alive, self.what = is_alive, what
        self.next_check = now + LIVENESS_INTERVAL

    def check(self) -> None:
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError(f"timed out waiting for {self.what}")
        if self.is_alive is not None and now >= self.next_check:
            self.next_check = now + LIVENESS_INTERVAL
            if not self.is_alive():
                raise PeerDiedError(f"peer died while waiting for {self.what}")

    def slice_ms(self) -> int:
        """How long one blocking poll may last before the next check."""
        left = LIVENESS_INTERVAL
        if self.deadline is not None:
            left = min(left, self.deadline - time.monotonic())
        return max(1, int(left * 1000))


class _RingEnd:
    def __init__(self, shm: shared_memory.SharedMemory, handle: RingHandle,
                 is_alive: Callable[[], bool] | None, context: zmq.Context | None):
        self.handle = handle
        self.layout = _Layout(handle)
        self._shm = shm
        self._buf = shm.buf
        self._is_alive = is_alive
        self._own_context = context is None
        self._context = context or zmq.Context()
        # NOTE: acquiring and releasing a lock is a full memory barrier; it keeps the flag and
        # payload stores in program order on weakly-ordered CPUs (x86 would not need it)
        self._fence_lock = threading.Lock()
        self._index = 0  # the next chunk this end writes or reads
        self._closed = False

    def _fence(self) -> None:
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _close_common(self, socket: zmq.Socket) -> None:
        socket.close(linger=0)
        if self._own_context:
            self._context.term()
        self._shm.close()  # also releases self._buf, the segment's memoryview

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


RING_PREFIX = "echo_ring_"
_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory; elsewhere nothing is swept


def _socket_path(name: str, socket_dir: str | None) -> str:
    return os.path.join(socket_dir or tempfile.gettempdir(), f"{name}.sock")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep_orphaned_rings(socket_dir: str | None = None) -> list[str]:
    """Unlink the segments (and their sockets in socket_dir) of rings whose writer process no
    longer exists; returns their names. A writer whose pid was reused keeps its segment."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return []
    swept = []
    for name in names:
        pid, _, token = name.removeprefix(RING_PREFIX).partition("_")
        if (not name.startswith(RING_PREFIX) or not pid.isdigit() or not token
                or _pid_alive(int(pid))):
            continue
        for path in (os.path.join(_SHM_DIR, name), _socket_path(name, socket_dir)):
            try:
                os.unlink(path)
            except OSError:  # gone meanwhile, or not ours to remove
                pass
        swept.append(name)
    return swept


class ShmRingWriter(_RingEnd):
    """The one writer: creates (and at close unlinks) the segment and the PUB socket."""

    def __init__(self, num_readers: int, num_chunks: int = 16, chunk_bytes: int = 1 << 20,
                 socket_dir: str | None = None, is_alive: Callable[[], bool] | None = None,
                 context: zmq.Context | None = None):
        if num_readers < 1 or num_chunks < 1 or chunk_bytes <= LENGTH.size:
            raise ValueError("need >= 1 reader, >= 1 chunk and chunks larger than 8 bytes")
        sweep_orphaned_rings(socket_dir)
        name = f"{RING_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        self._socket_path = _socket_path(name, socket_dir)
        handle = RingHandle(name, num_readers, num_chunks, chunk_bytes,
                            f"ipc://{self._socket_path}")
        shm = shared_memory.SharedMemory(name=name, create=True,
                                         size=_Layout(handle).total_bytes)
        super().__init__(shm, handle, is_alive, context)
        self._pub = self._context.socket(zmq.PUB)
        try:
            shm.buf[:] = bytes(shm.size)  # Linux zero-fills new segments; other systems may not
            self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop: an oversize payload lives only here
            self._pub.bind(handle.pub_address)
        except BaseException:  # e.g. a socket path over the OS limit: leave no segment behind
            self._close_common(self._pub)
            shm.unlink()
            raise
        self._all_subscribed = False

    # ---- the subscription handshake (ZMQ's slow joiner) -----------------------------------

    def all_readers_subscribed(self) -> bool:
        if not self._all_subscribed:
            flags = bytes(self._buf[:self.layout.num_readers])
            self._all_subscribed = flags == b"\x01" * self.layout.num_readers
        return self._all_subscribed

    def publish_hello(self) -> None:
        """A subscriber that connected late misses earlier messages: keep saying hello until
        every reader has heard one and marked itself subscribed in the segment."""
        self._pub.send(HELLO)

    def wait_for_readers(self, timeout: float | None = None) -> None:
        waiter = _Waiter(timeout, self._is_alive, "ring readers to subscribe")
        while not self.all_readers_subscribed():
            self.publish_hello()
            waiter.check()
            time.sleep(0.005)

    # ---- writing --------------------------------------------------------------------------

    def enqueue(self, payload: bytes, timeout: float | None = None) -> None:
        """Broadcast one message; blocks while the next chunk is unread by some reader."""
        if not self.all_readers_subscribed():
            self.wait_for_readers(timeout)
        layout, buf = self.layout, self._buf
        meta = layout.meta(self._index)
        self._wait_until_free(meta, timeout)
        n = layout.num_readers
        buf[meta] = 0
        self._fence()
        buf[meta + 1:meta + 1 + n] = bytes(n)
        self._fence()
        start = layout.chunk(self._index)
        oversize = len(payload) > layout.capacity
        if oversize:
            # published before the flag: the reader that sees the flag finds it on its way
            self._pub.send_multipart([DATA, payload], copy=False)
            LENGTH.pack_into(buf, start, OVERSIZE)
        else:
            LENGTH.pack_into(buf, start, len(payload))
            buf[start + LENGTH.size:start + LENGTH.size + len(payload)] = payload
        self._fence()
        buf[meta] = 1
        self._fence()
        if not oversize:
            self._pub.send(WAKE)
        self._index = (self._index + 1) % layout.num_chunks

    def _chunk_free(self, meta: int) -> bool:
        buf, n = self._buf, self.layout.num_readers
        return buf[meta] == 0 or bytes(buf[meta + 1:meta + 1 + n]) == b"\x01" * n

    def _wait_until_free(self, meta: int, timeout: float | None) -> None:
        if self._chunk_free(meta):
            return
        # a full ring means readers lag behind by num_chunks messages: rare, so back off to
        # sleeps of up to a millisecond instead of spinning
        waiter = _Waiter(timeout, self._is_alive, "ring readers to free a chunk")
        pause = 1e-5
        while not self._chunk_free(meta):
            waiter.check()
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_common(self._pub)
        try:
            os.unlink(self._socket_path)
        except FileNotFoundError:
            pass
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


class ShmRingReader(_RingEnd):
    """One of the readers, attached to a writer's segment by its handle."""

    def __init__(self, handle: RingHandle, reader_rank: int,
                 is_alive: Callable[[], bool] | None = None, context: zmq.Context | None = None):
        if not 0 <= reader_rank < handle.num_readers:
            raise ValueError(f"reader rank {reader_rank} outside [0, {handle.num_readers})")
        # Python 3.13 can attach without registering with the resource tracker
        track = {"track": False} if sys.version_info >= (3, 13) else {}
        shm = shared_memory.SharedMemory(name=handle.shm_name, create=False, **track)
        super().__init__(shm, handle, is_alive, context)
        self.rank = reader_rank
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(handle.pub_address)
        self._subscribed = False
        self._oversize: deque[bytes] = deque()  # payloads that arrived on the socket, in order
        self._reads_since_drain = 0

    def wait_for_writer(self, timeout: float | None = None) -> None:
        """Wait for the writer's hello, then mark this reader subscribed in the segment."""
        waiter = _Waiter(timeout, self._is_alive, "the ring writer's hello")
        while not self._subscribed:
            if self._sub.poll(waiter.slice_ms()):
                self._drain()  # the hello may come behind nothing else: nothing is sent before
                self._subscribed = True
                self._buf[self.rank] = 1
            else:
                waiter.check()

    def has_message(self) -> bool:
        """Whether dequeue() would return at once (never blocks)."""
        return self._subscribed and self._chunk_written(self.layout.meta(self._index))

    def dequeue(self, timeout: float | None = None) -> bytes:
        """The next message; blocks (without CPU once past a short spin) until it is written."""
        if not self._subscribed:
            self.wait_for_writer(timeout)
        layout, buf = self.layout, self._buf
        meta = layout.meta(self._index)
        self._wait_until_written(meta, timeout)
        start = layout.chunk(self._index)
        (length,) = LENGTH.unpack_from(buf, start)
        if length == OVERSIZE:
            payload = self._next_oversize(timeout)
        else:
            payload = bytes(buf[start + LENGTH.size:start + LENGTH.size + length])
        self._fence()
        buf[meta + 1 + self.rank] = 1
        self._index = (self._index + 1) % layout.num_chunks
        self._reads_since_drain += 1
        if self._reads_since_drain >= DRAIN_EVERY:
            self._drain()
        return payload

    def _chunk_written(self, meta: int) -> bool:
        # NOTE: own read flag first: seeing the writer's read=0 implies its earlier written=0
        # is visible too, so a stale written=1 from the chunk's previous lap is never taken
        if self._buf[meta + 1 + self.rank]:
            return False
        self._fence()
        return self._buf[meta] == 1

    def _wait_until_written(self, meta: int, timeout: float | None) -> None:
        spin_until = time.perf_counter() + SPIN_SECONDS
        while not self._chunk_written(meta):
            if time.perf_counter() >= spin_until:
                break
        else:
            return
        waiter = _Waiter(timeout, self._is_alive, "the next ring message")
        while True:
            # drain before checking: a wake-up taken here was sent after its chunk was written
            self._drain()
            if self._chunk_written(meta):
                return
            waiter.check()
            self._sub.poll(waiter.slice_ms())

    def _next_oversize(self, timeout: float | None) -> bytes:
        waiter = _Waiter(timeout, self._is_alive, "an oversize ring message")
        while not self._oversize:
            self._drain()
            if self._oversize:
                break
            waiter.check()
            self._sub.poll(waiter.slice_ms())
        return self._oversize.popleft()

    def _drain(self) -> None:
        """Take every queued socket message: keep payloads, drop hellos and wake-ups."""
        self._reads_since_drain = 0
        while self._sub.poll(0):
            frames = self._sub.recv_multipart()
            if frames[0] == DATA:
                self._oversize.append(frames[1])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_common(self._sub)
