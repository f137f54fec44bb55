"""The shm ring broadcast: order, oversize messages, several readers, back-pressure, idle CPU,
timeouts and dead peers. Readers run in threads where that suffices, in processes where the
behaviour is about processes."""

import multiprocessing
import os
import sys
import threading
import time

import pytest

from echo.executor.shm_broadcast import (
    PeerDiedError,
    ShmRingReader,
    ShmRingWriter,
)
from tests.executor import ring_peers

CHUNK = 256  # bytes per chunk in most tests: capacity = CHUNK - 8 bytes of length


@pytest.fixture
def make_writer(tmp_path):
    writers = []

    def make(num_readers=1, num_chunks=4, chunk_bytes=CHUNK, **kwargs) -> ShmRingWriter:
        writer = ShmRingWriter(num_readers, num_chunks, chunk_bytes, socket_dir=str(tmp_path),
                               **kwargs)
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.close()


@pytest.fixture
def spawn():
    """Start a process; every one is killed by pid (if still running) when the test ends."""
    context = multiprocessing.get_context("spawn")
    started = []

    def start(target, *args) -> multiprocessing.Process:
        process = context.Process(target=target, args=args, daemon=True)
        process.start()
        started.append(process)
        return process

    start.Queue = context.Queue
    yield start
    for process in started:
        if process.exitcode is None:
            process.kill()
        process.join(timeout=5)


def start_reader_thread(handle, rank: int, count: int, received: list, errors: list,
                        gate: threading.Event | None = None) -> threading.Thread:
    """Read `count` messages into `received`; with a gate, subscribe first and read only
    once the gate opens."""

    def run():
        try:
            with ShmRingReader(handle, rank) as reader:
                reader.wait_for_writer(timeout=10)
                if gate is not None:
                    gate.wait(timeout=10)
                for _ in range(count):
                    received.append(reader.dequeue(timeout=10))
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def subscribe_in_this_thread(writer: ShmRingWriter, reader: ShmRingReader) -> None:
    """Writer and reader in one thread: say hello until the reader hears one."""
    for _ in range(200):
        writer.publish_hello()
        try:
            reader.wait_for_writer(timeout=0.01)
            break
        except TimeoutError:
            pass
    assert writer.all_readers_subscribed()


def send_to_one_reader(writer, messages: list[bytes]) -> list[bytes]:
    """Enqueue every message while a reader thread takes them; what the reader received."""
    received, errors = [], []
    thread = start_reader_thread(writer.handle, 0, len(messages), received, errors)
    for message in messages:
        writer.enqueue(message, timeout=10)
    thread.join(timeout=30)
    assert not errors
    return received


def test_messages_arrive_in_order_over_many_laps(make_writer):
    writer = make_writer(num_chunks=4)
    capacity = CHUNK - 8
    messages = [bytes([i % 251]) * (i % (capacity + 1)) for i in range(2000)]
    received = send_to_one_reader(writer, messages)
    assert received == messages


def test_oversize_messages_travel_on_the_socket_and_keep_their_place(make_writer):
    writer = make_writer(num_chunks=4)
    capacity = CHUNK - 8
    sizes = [capacity, capacity + 1, 0, 100_000, 5, 3 * 2**20, capacity] + [10_000] * 20
    messages = [os.urandom(size) for size in sizes]
    received = send_to_one_reader(writer, messages)
    assert [len(m) for m in received] == sizes
    assert received == messages


def test_two_reader_processes_receive_the_same_stream(make_writer, spawn):
    writer = make_writer(num_readers=2, num_chunks=8, chunk_bytes=4096)
    messages = [os.urandom(50_000 if i % 50 == 7 else i % 3000) for i in range(600)]
    results = spawn.Queue()
    for rank in range(2):
        spawn(ring_peers.read_and_digest, writer.handle, rank, len(messages), results)
    for message in messages:
        writer.enqueue(message, timeout=30)
    reports = sorted(results.get(timeout=30) for _ in range(2))
    expected = ring_peers.digest(messages)
    assert reports == [(0, len(messages), expected), (1, len(messages), expected)]


def test_writer_blocks_while_a_reader_lags_then_proceeds(make_writer):
    writer = make_writer(num_chunks=4)
    gate, received, errors = threading.Event(), [], []
    reader = start_reader_thread(writer.handle, 0, 5, received, errors, gate)
    writer.wait_for_readers(timeout=10)
    sent = []

    def write_five():
        for i in range(5):
            writer.enqueue(bytes([i]), timeout=10)
            sent.append(i)

    writer_thread = threading.Thread(target=write_five, daemon=True)
    writer_thread.start()
    time.sleep(0.3)
    assert sent == [0, 1, 2, 3] and writer_thread.is_alive()  # the ring is full
    gate.set()
    writer_thread.join(timeout=10)
    reader.join(timeout=10)
    assert sent == [0, 1, 2, 3, 4]
    assert received == [bytes([i]) for i in range(5)] and not errors


def test_an_idle_reader_blocks_without_using_cpu(make_writer, spawn):
    writer = make_writer()
    results = spawn.Queue()
    spawn(ring_peers.read_one_and_time_cpu, writer.handle, results)
    writer.wait_for_readers(timeout=30)
    assert results.get(timeout=30) == "subscribed"
    time.sleep(0.5)
    writer.enqueue(b"wake up", timeout=10)
    message, wall, cpu = results.get(timeout=30)
    assert message == b"wake up"
    assert wall >= 0.4
    assert cpu < 0.05, f"the idle reader used {cpu * 1000:.1f} ms of CPU in {wall:.2f} s"


def test_reader_times_out_and_notices_a_dead_writer(make_writer):
    writer = make_writer()
    alive = [True]
    with ShmRingReader(writer.handle, 0, is_alive=lambda: alive[0]) as reader:
        subscribe_in_this_thread(writer, reader)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.3)
        assert 0.3 <= time.monotonic() - start < 1.0
        alive[0] = False
        start = time.monotonic()
        with pytest.raises(PeerDiedError):
            reader.dequeue()
        assert time.monotonic() - start < 1.0
        # nothing was lost: the ring still works once there is something to read
        writer.enqueue(b"late", timeout=1)
        assert reader.dequeue(timeout=1) == b"late"


def test_writer_notices_a_dead_reader(make_writer, spawn):
    readers = []
    writer = make_writer(num_chunks=2,
                         is_alive=lambda: all(r.exitcode is None for r in readers))
    results = spawn.Queue()
    readers.append(spawn(ring_peers.subscribe_then_idle, writer.handle, results))
    writer.wait_for_readers(timeout=30)
    assert results.get(timeout=30) == "subscribed"
    writer.enqueue(b"1", timeout=1)
    writer.enqueue(b"2", timeout=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError):  # alive but not reading: only the timeout helps
        writer.enqueue(b"3", timeout=0.3)
    assert time.monotonic() - start < 1.0
    readers[0].kill()
    readers[0].join(timeout=5)
    start = time.monotonic()
    with pytest.raises(PeerDiedError):
        writer.enqueue(b"3")
    assert time.monotonic() - start < 1.0


def test_close_removes_the_segment_and_the_socket(make_writer):
    writer = make_writer()
    reader = ShmRingReader(writer.handle, 0)
    socket_path = writer.handle.pub_address.removeprefix("ipc://")
    shm_path = f"/dev/shm/{writer.handle.shm_name}"
    assert os.path.exists(socket_path)
    if sys.platform == "linux":
        assert os.path.exists(shm_path)
    reader.close()
    writer.close()
    writer.close()  # idempotent
    assert not os.path.exists(socket_path)
    assert not os.path.exists(shm_path)


def test_a_writer_that_cannot_bind_leaves_no_segment(tmp_path):
    import zmq

    from tests.engine.test_multiprocess import shm_segments

    # a unix socket path is limited to ~107 bytes: the PUB bind fails after the segment exists
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    before = shm_segments()
    with pytest.raises(zmq.ZMQError):
        ShmRingWriter(1, 4, CHUNK, socket_dir=str(deep))
    assert shm_segments() <= before


def test_reader_rank_must_be_in_range(make_writer):
    writer = make_writer(num_readers=2)
    with pytest.raises(ValueError, match="reader rank 2"):
        ShmRingReader(writer.handle, 2)


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX shared memory lives in /dev/shm")
def test_a_new_writer_sweeps_the_rings_of_writers_that_died(make_writer, tmp_path):
    """A writer SIGKILLed with its resource tracker leaves its segment and socket; the next
    writer removes them, and leaves a live writer's alone."""
    import subprocess

    code = ("import os, signal, sys; from echo.executor.shm_broadcast import ShmRingWriter; "
            f"w = ShmRingWriter(1, 4, {CHUNK}, socket_dir=sys.argv[1]); "
            "print(w.handle.shm_name, flush=True); os.killpg(0, signal.SIGKILL)")
    # its own process group, so the kill takes its resource tracker too
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        name = child.stdout.readline().strip()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert name.startswith(f"echo_ring_{child.pid}_")
    assert os.path.exists(f"/dev/shm/{name}") and os.path.exists(tmp_path / f"{name}.sock")
    live = make_writer()
    make_writer()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(tmp_path / f"{name}.sock")
    assert os.path.exists(f"/dev/shm/{live.handle.shm_name}")
