"""Every test here must leave no process behind: a safety net that finds surviving children,
ends them by pid (through their Process objects) and fails the test that left them."""

import multiprocessing

import pytest


@pytest.fixture(autouse=True)
def no_leftover_processes():
    # active_children() lists what multiprocessing started from this process (the workers of
    # every executor a test builds here), not the resource tracker, which outlives the tests
    before = {p.pid for p in multiprocessing.active_children()}
    yield
    survivors = [p for p in multiprocessing.active_children() if p.pid not in before]
    for process in survivors:
        process.kill()
        process.join(timeout=5)
    assert not survivors, f"the test left processes behind: {[p.pid for p in survivors]}"
