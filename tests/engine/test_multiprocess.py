"""The multi-process engine end to end on CPU: TP=1 and TP=2 (gloo) against the in-process LLM,
many concurrent streams, cancellation, async scheduling on/off, and faults (killed worker,
killed frontend, SIGTERM)."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from echo import LLM, SamplingParams
from echo.engine.async_client import AsyncClient, EngineDeadError
from tests.entrypoints.test_llm import PROMPTS

ARGS = {"device": "cpu", "num_gpu_blocks_override": 256, "max_num_seqs": 16,
        "max_model_len": 256}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("echo_ring_*")}


async def final(client, prompt, params):
    last = None
    async for out in client.generate(prompt, params):
        last = out
    return last


@pytest.mark.parametrize("fixture,tp", [
    ("tiny_qwen3", 1), ("tiny_qwen3", 2),
    # one KV head replicated on both ranks, and a vocabulary (127) split unevenly
    ("tiny_llama_kv1_odd_vocab", 2),
])
def test_tp_outputs_equal_in_process_llm(fixture, tp, request):
    folder = str(request.getfixturevalue(fixture))
    expected = LLM(folder, **ARGS).generate(PROMPTS, GREEDY, use_tqdm=False)

    async def main():
        async with AsyncClient(folder, tensor_parallel_size=tp, **ARGS) as client:
            return await asyncio.gather(*(final(client, p, GREEDY) for p in PROMPTS))

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in expected]


def test_default_model_streams_concatenate_to_offline_text(smollm2_llm_args):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=24)
    offline = LLM("default", **smollm2_llm_args).chat(question, params, use_tqdm=False)[0]

    async def main():
        async with AsyncClient("default", **smollm2_llm_args) as client:
            return [o async for o in client.generate(question, params)]

    stream = asyncio.run(main())
    assert "".join(o.outputs[0].delta_text for o in stream) == offline.outputs[0].text
    assert stream[-1].outputs[0].token_ids == offline.outputs[0].token_ids


@pytest.fixture(scope="module")
def smollm2_llm_args():
    return {"device": "cpu", "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4}


def test_64_concurrent_streams_and_20_cancelled_free_their_blocks(tiny_llama):
    prompts = [[1 + (7 * i) % 120, 2 + i % 50, 3] for i in range(64)]
    expected = LLM(str(tiny_llama), **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def cancelled(client, prompt):
        async for out in client.generate(prompt, long):
            if len(out.outputs[0].token_ids) >= 3:
                break  # leaving the stream aborts the request

    async def main():
        async with AsyncClient(str(tiny_llama), **ARGS) as client:
            results = await asyncio.gather(
                *(final(client, p, GREEDY) for p in prompts),
                *(cancelled(client, p) for p in prompts[:20]))
            for _ in range(100):
                stats = await client.stats()
                if stats.num_running == 0 and stats.kv_cache_usage == 0:
                    break
                await asyncio.sleep(0.05)
            return results[:64], stats

    outs, stats = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in expected]
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_async_scheduling_on_and_off_agree_and_stop_exactly(tiny_llama):
    free = LLM(str(tiny_llama), **ARGS).generate(PROMPTS, GREEDY, use_tqdm=False)
    stop_token = free[0].outputs[0].token_ids[4]
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True,
                             stop_token_ids=[stop_token]) for i in range(len(PROMPTS))]

    async def run(async_scheduling):
        async with AsyncClient(str(tiny_llama), async_scheduling=async_scheduling,
                               **ARGS) as client:
            return await asyncio.gather(*(final(client, p, sp)
                                          for p, sp in zip(PROMPTS, params)))

    on, off = asyncio.run(run(True)), asyncio.run(run(False))
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    for out, ref, sp in zip(on, free, params):
        tokens = ref.outputs[0].token_ids
        end = tokens.index(stop_token) + 1 if stop_token in tokens[:sp.max_tokens] \
            else sp.max_tokens
        assert out.outputs[0].token_ids == tokens[:end]


def test_killed_worker_fails_pending_requests_and_refuses_new_ones(tiny_llama):
    before = shm_segments()

    async def main():
        async with AsyncClient(str(tiny_llama), **ARGS) as client:
            core = client.proc.pid
            workers = child_pids(core)
            assert workers
            long = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
            streams = [client.generate(p, long) for p in PROMPTS]
            for s in streams:
                await s.__anext__()
            os.kill(workers[0], signal.SIGKILL)
            start = time.time()
            for s in streams:
                with pytest.raises(EngineDeadError):
                    async for _ in s:
                        pass
            elapsed = time.time() - start
            with pytest.raises(EngineDeadError):
                await final(client, PROMPTS[0], GREEDY)
            return elapsed, [core, *workers]

    elapsed, pids = asyncio.run(main())
    assert elapsed < 5
    assert wait_gone(pids, 5) == []
    assert shm_segments() <= before


FRONTEND = textwrap.dedent("""
    import asyncio, sys
    from echo import AsyncClient, SamplingParams

    async def main():
        client = await AsyncClient(sys.argv[1], device="cpu", num_gpu_blocks_override=64,
                                   max_model_len=256).start()
        print(client.proc.pid, flush=True)
        async for _ in client.generate([1, 2, 3], SamplingParams(max_tokens=100000 // 1000,
                                                                 ignore_eos=True)):
            pass
        await asyncio.sleep(3600)

    if __name__ == "__main__":
        asyncio.run(main())
""")


def test_killed_frontend_takes_core_and_workers_down(tiny_llama, tmp_path):
    before = shm_segments()
    script = tmp_path / "frontend.py"
    script.write_text(FRONTEND)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_llama)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        core = int(proc.stdout.readline())
        time.sleep(1.0)
        pids = [core, *child_pids(core)]
        assert len(pids) >= 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_gone(pids, 5) == []
        assert wait_gone([], 0) == [] and shm_segments() <= before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_worker_process_equals_in_process_llm(tiny_qwen3, tp):
    import torch

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")  # make test-gpu on the one-GPU machine
    args = {**ARGS, "device": "cuda", "dtype": "float32"}
    expected = LLM(str(tiny_qwen3), **args).generate(PROMPTS, GREEDY, use_tqdm=False)

    async def main():
        async with AsyncClient(str(tiny_qwen3), tensor_parallel_size=tp, **args) as client:
            return await asyncio.gather(*(final(client, p, GREEDY) for p in PROMPTS))

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in expected]
