"""Programs for executor tests that need a process of their own (importable by the child)."""

import time

from echo.config import EngineConfig
from echo.executor.multiproc import MultiprocExecutor


def start_executor_then_hang(config: EngineConfig, results) -> None:
    """Start an executor, report its workers' pids and its files, then wait to be killed by the
    test: the workers must notice their parent is gone, clean up and exit on their own."""
    executor = MultiprocExecutor(config)
    results.put((executor.worker_pids, executor._workdir, executor._ring.handle.shm_name))
    time.sleep(600)
