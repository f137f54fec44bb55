"""MultiprocExecutor against the in-process UniprocExecutor on tiny random models (CPU, gloo):
same outputs with TP=1 and TP=2, two steps in flight, EngineCore driving it unchanged; worker
errors reported verbatim; dead workers and dead parents detected; nothing left behind."""

import multiprocessing
import os
import shutil
import signal
import sys
import time

import pytest

from echo.config import EngineConfig
from echo.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from echo.core.step_results import ModelRunnerOutput
from echo.engine.core import EngineCore
from echo.engine.messages import EngineCoreRequest
from echo.executor.multiproc import MultiprocExecutor
from echo.executor.uniproc import UniprocExecutor
from echo.sampling_params import SamplingParams
from tests.executor import executor_peers

NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_config(folder, tp: int = 1) -> EngineConfig:
    return EngineConfig.create(str(folder), device="cpu", dtype="float32", block_size=16,
                               num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=8, tp=tp)


def handcrafted_steps() -> list[SchedulerOutput]:
    """A chunked prefill next to a plain one, then decodes; a request finishes and a seeded,
    sampled one with logprobs arrives. Blocks: r0 [0], r1 [1, 2], r2 [3]."""
    prompt0, prompt1, prompt2 = [1, 5, 9, 33, 7], list(range(3, 23)), [1, 2, 3, 4]
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, logprobs=2)
    return [
        SchedulerOutput(0, [NewRequestData("r0", prompt0, GREEDY, [0], 0),
                            NewRequestData("r1", prompt1, GREEDY, [1, 2], 0)],
                        num_scheduled_tokens={"r0": 5, "r1": 12}, total_num_scheduled_tokens=17),
        SchedulerOutput(1, scheduled_cached_reqs=CachedRequestData(["r0", "r1"], [[], []],
                                                                   [5, 12]),
                        num_scheduled_tokens={"r0": 1, "r1": 8}, total_num_scheduled_tokens=9),
        SchedulerOutput(2, scheduled_cached_reqs=CachedRequestData(["r0", "r1"], [[], []],
                                                                   [6, 20]),
                        num_scheduled_tokens={"r0": 1, "r1": 1}, total_num_scheduled_tokens=2),
        SchedulerOutput(3, [NewRequestData("r2", prompt2, sampled, [3], 0)],
                        CachedRequestData(["r0"], [[]], [7]), {"r0": 1, "r2": 4}, 5,
                        finished_req_ids=["r1"]),
    ]


def assert_same_output(got: ModelRunnerOutput, expected: ModelRunnerOutput, exact: bool):
    if exact:
        assert got == expected
        return
    # TP=2 sums in another order: the same tokens, logprobs equal to rounding
    assert (got.step_id, got.req_ids, got.sampled_token_ids) == \
        (expected.step_id, expected.req_ids, expected.sampled_token_ids)
    assert len(got.logprobs) == len(expected.logprobs)
    for entries_a, entries_b in zip(got.logprobs, expected.logprobs):
        assert (entries_a is None) == (entries_b is None)
        for a, b in zip(entries_a or [], entries_b or [], strict=True):
            assert a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


def greedy_tokens(core: EngineCore, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"q{i}", prompt, GREEDY))
    tokens = {f"q{i}": [] for i in range(len(prompts))}
    while core.has_work():
        step = core.step_overlapped()
        for output in step.outputs if step is not None else ():
            tokens[output.request_id] += output.new_token_ids
    return tokens


def shutdown_and_reap(executor: MultiprocExecutor) -> None:
    """Shut down; should that fail, still end every worker by pid."""
    try:
        executor.shutdown()
    finally:
        for worker in executor._workers:
            if worker.exitcode is None:
                worker.kill()
                worker.join(timeout=5)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def executor(request, tiny_qwen3):
    executor = MultiprocExecutor(make_config(tiny_qwen3, request.param))
    try:
        yield executor
    finally:
        shutdown_and_reap(executor)


@pytest.fixture(scope="module")
def uniproc_outputs(tiny_qwen3) -> list[ModelRunnerOutput]:
    runner = UniprocExecutor(make_config(tiny_qwen3))
    runner.init_kv_cache(NUM_BLOCKS)
    return [runner.execute_model(step) for step in handcrafted_steps()]


def test_handcrafted_steps_match_uniproc_with_two_in_flight(executor, uniproc_outputs):
    assert executor.determine_num_blocks() == NUM_BLOCKS
    executor.init_kv_cache(NUM_BLOCKS)
    steps = handcrafted_steps()
    outputs = []
    for first, second in ((0, 1), (2, 3)):  # broadcast two, then collect both, oldest first
        executor.execute_model_async(steps[first])
        executor.execute_model_async(steps[second])
        outputs += [executor.get_output(), executor.get_output()]
    for got, expected in zip(outputs, uniproc_outputs):
        assert_same_output(got, expected, exact=executor.tp_size == 1)
    # the steps exercised what they meant to: an unfinished chunk, a sampled request's logprobs
    assert outputs[0].sampled_token_ids[1] == [] and len(outputs[1].sampled_token_ids[1]) == 1
    assert outputs[3].req_ids == ["r0", "r2"] and len(outputs[3].logprobs[1][0].top_token_ids) == 2
    with pytest.raises(RuntimeError, match="without a step in flight"):
        executor.get_output()


def test_engine_core_gives_the_same_greedy_tokens(executor, tiny_qwen3):
    prompts = [[1, 17, 42, 99, 5], list(range(10, 60)), [1] + [7, 8, 9] * 9]
    expected = greedy_tokens(EngineCore(make_config(tiny_qwen3)), prompts)
    got = greedy_tokens(EngineCore(make_config(tiny_qwen3, executor.tp_size),
                                   executor=executor), prompts)
    assert got == expected
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got.values())


def test_shutdown_stops_workers_cleanly_and_removes_everything(executor):
    # runs last for each executor (pytest groups the tests of a module-scoped parameter)
    workers, workdir = list(executor._workers), executor._workdir
    shm_path = f"/dev/shm/{executor._ring.handle.shm_name}"
    executor.shutdown()
    executor.shutdown()  # idempotent
    assert [w.exitcode for w in workers] == [0] * executor.tp_size  # not killed: they exited
    assert not os.path.exists(workdir)
    assert not os.path.exists(shm_path)
    with pytest.raises(RuntimeError, match="shut down"):
        executor.determine_num_blocks()


def test_a_worker_that_fails_to_start_reports_its_error_verbatim(tiny_qwen3, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    shutil.copy(tiny_qwen3 / "config.json", corrupt)
    (corrupt / "model.safetensors").write_bytes(b"these are not weights")
    config = make_config(corrupt)
    with pytest.raises(Exception) as in_process:  # the same failure, in this process
        UniprocExecutor(config)
    with pytest.raises(RuntimeError, match="worker rank 0 failed while starting") as info:
        MultiprocExecutor(config, startup_timeout=120)
    assert str(in_process.value) in str(info.value)
    assert type(in_process.value).__name__ in str(info.value)


def test_a_script_without_a_main_guard_is_told_why_its_workers_exit(tiny_llama, tmp_path):
    import subprocess

    from echo.executor.multiproc import MAIN_GUARD_HINT

    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\nfrom echo import LLM\n"
        "LLM(sys.argv[1], device='cpu', tensor_parallel_size=2, num_gpu_blocks_override=64,\n"
        "    max_model_len=128)\n")
    done = subprocess.run([sys.executable, str(script), str(tiny_llama)], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 1
    # the parent's error (the last traceback's message, after the workers' own tracebacks)
    parent_error = done.stderr[done.stderr.rindex("RuntimeError: worker rank"):]
    assert "while starting the workers" in parent_error and MAIN_GUARD_HINT in parent_error


def test_an_executor_that_cannot_bind_leaves_nothing_behind(tiny_qwen3, tmp_path, monkeypatch):
    import tempfile

    import zmq

    from tests.engine.test_multiprocess import shm_segments

    # the executor's sockets live in a temporary folder; unix socket paths end at ~107 bytes
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    before = shm_segments()
    with pytest.raises(zmq.ZMQError):
        MultiprocExecutor(make_config(tiny_qwen3, tp=2))
    assert os.listdir(deep) == []
    assert shm_segments() <= before


def test_a_failing_step_reports_the_worker_traceback(tiny_qwen3):
    executor = MultiprocExecutor(make_config(tiny_qwen3))
    try:
        executor.init_kv_cache(NUM_BLOCKS)
        unknown = SchedulerOutput(0, scheduled_cached_reqs=CachedRequestData(["ghost"], [[]], [3]),
                                  num_scheduled_tokens={"ghost": 1}, total_num_scheduled_tokens=1)
        with pytest.raises(RuntimeError, match=r"(?s)failed while executing step 0.*KeyError"):
            executor.execute_model(unknown)
        with pytest.raises(RuntimeError, match="KeyError"):  # stays failed, does not hang
            executor.execute_model(handcrafted_steps()[0])
        assert all(w.exitcode is not None for w in executor._workers)
    finally:
        shutdown_and_reap(executor)


def test_a_worker_stuck_while_alive_fails_the_step_after_the_timeout(tiny_qwen3):
    executor = MultiprocExecutor(make_config(tiny_qwen3, tp=2), step_timeout=3)
    try:
        executor.init_kv_cache(NUM_BLOCKS)
        stuck = executor._workers[1]
        os.kill(stuck.pid, signal.SIGSTOP)  # alive, never answering: as a hung collective
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timed out after 3 s while executing step 0"):
            executor.execute_model(handcrafted_steps()[0])
        assert 3 <= time.monotonic() - start < 15
        assert [w.exitcode for w in executor._workers] == [-signal.SIGKILL] * 2
    finally:
        shutdown_and_reap(executor)


@pytest.mark.slow
def test_a_killed_worker_fails_the_next_step_within_seconds(tiny_llama):
    config = make_config(tiny_llama, tp=2)
    reference = UniprocExecutor(make_config(tiny_llama))
    reference.init_kv_cache(NUM_BLOCKS)
    steps = handcrafted_steps()
    executor = MultiprocExecutor(config)
    try:
        executor.init_kv_cache(NUM_BLOCKS)
        assert_same_output(executor.execute_model(steps[0]), reference.execute_model(steps[0]),
                           exact=False)
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with signal "
                                               "SIGKILL while executing step 1"):
            executor.execute_model(steps[1])
        assert time.monotonic() - start < 5
        assert all(w.exitcode is not None for w in executor._workers)  # rank 0 ended too
    finally:
        shutdown_and_reap(executor)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_workers_exit_and_clean_up_when_their_parent_dies(tiny_qwen3):
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    parent = spawn.Process(target=executor_peers.start_executor_then_hang,
                           args=(make_config(tiny_qwen3), results))
    parent.start()
    worker_pids = []
    try:
        worker_pids, workdir, shm_name = results.get(timeout=120)
        assert os.path.isdir(workdir)
        parent.kill()
        parent.join(timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_running(pid) for pid in worker_pids):
            time.sleep(0.05)
        assert not any(_running(pid) for pid in worker_pids)
        # what the killed parent could not clean, its workers did
        assert not os.path.exists(workdir)
        assert not os.path.exists(f"/dev/shm/{shm_name}")
    finally:
        if parent.exitcode is None:
            parent.kill()
            parent.join(timeout=5)
        for pid in worker_pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether a process that is not our child (so not ours to wait for) still runs."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
