"""Reader-side programs for the ring tests, run in spawned processes (importable by the child).

Each reports back through a multiprocessing queue (pickle is fine inside our own process tree).
"""

import hashlib
import time

from echo.executor.shm_broadcast import RingHandle, ShmRingReader


def digest(messages) -> str:
    h = hashlib.sha256()
    for message in messages:
        h.update(len(message).to_bytes(8, "little"))
        h.update(message)
    return h.hexdigest()


def read_and_digest(handle: RingHandle, rank: int, count: int, results) -> None:
    """Read `count` messages and report how many and their digest."""
    with ShmRingReader(handle, rank) as reader:
        messages = [reader.dequeue(timeout=30) for _ in range(count)]
    results.put((rank, len(messages), digest(messages)))


def read_one_and_time_cpu(handle: RingHandle, results) -> None:
    """Subscribe, say so, then wait for one message: report the CPU time the wait took."""
    with ShmRingReader(handle, 0) as reader:
        reader.wait_for_writer(timeout=30)
        results.put("subscribed")
        wall, cpu = time.perf_counter(), time.process_time()
        message = reader.dequeue(timeout=30)
        results.put((message, time.perf_counter() - wall, time.process_time() - cpu))


def subscribe_then_idle(handle: RingHandle, results) -> None:
    """Subscribe and then never read: a reader that lags forever (killed by the test)."""
    reader = ShmRingReader(handle, 0)
    reader.wait_for_writer(timeout=30)
    results.put("subscribed")
    time.sleep(600)
