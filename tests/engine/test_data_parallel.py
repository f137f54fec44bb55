"""Data parallelism end to end on CPU, on both backends: two SmolLM2 replicas behind one
AsyncClient (mp: processes of this node; ray: actors on a Ray cluster the test starts on
127.0.0.1): greedy outputs equal one engine's, the cache-aware router keeps a prefix on one
replica and spreads unrelated prompts, round-robin alternates, a killed replica fails only its
own requests and serves again, the offline LLM spreads a batch, and nothing is left running
after shutdown."""

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import msgspec
import pytest

from echo import LLM, SamplingParams
from echo.core.step_results import SchedulerStats
from echo.engine.async_client import AsyncClient, EngineDeadError
from tests.engine.test_multiprocess import child_pids, wait_gone

ARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "max_num_seqs": 8,
        "num_gpu_blocks_override": 256}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
RESTART_WITHIN_S = 60
# unrelated prompts: each its own first tokens, so no two share a block
UNRELATED = [[100 + 37 * i + j for j in range(40)] for i in range(8)]


@pytest.fixture(scope="module")
def smollm2():
    from echo.models.default_model import ensure_default_model

    return str(ensure_default_model())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster of 4 CPUs on 127.0.0.1 with its own temp dir, in its own process
    group, killed (by that group, which holds every process Ray starts) at the end."""
    pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="echo-ray-")
    port = _free_port()
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
         "--num-cpus", "4", "--num-gpus", "0", "--port", str(port),
         "--object-store-memory", str(200 * 2**20),  # the replicas pass nothing through it
         "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir,
         "--include-dashboard=false", "--disable-usage-stats"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(30)
        shutil.rmtree(temp_dir, ignore_errors=True)


# the Ray backend's runs and the offline batch are end to end checks of make test-slow (.ci/run
# runs it after make test, whose 25 minutes they would overrun); make test keeps mp's
# end to end with replica processes (1-2 minutes each on 2 cores): make test-slow runs them;
# the router's choices are tested without processes in test_router.py
BACKENDS = [pytest.param(backend, marks=pytest.mark.slow) for backend in ("mp", "ray")]
OFFLINE_BACKENDS = [pytest.param(backend, marks=pytest.mark.slow) for backend in ("mp", "ray")]


@pytest.fixture(params=BACKENDS)
def backend_args(request):
    return _backend_args(request)


@pytest.fixture(params=OFFLINE_BACKENDS)
def offline_backend_args(request):
    return _backend_args(request)


def _backend_args(request) -> dict:
    if request.param == "ray":
        return {"data_parallel_backend": "ray",
                "ray_address": request.getfixturevalue("ray_cluster")}
    return {"data_parallel_backend": "mp"}


@pytest.fixture(scope="module")
def expected(smollm2):
    """One engine's greedy tokens for the unrelated prompts and the shared-prefix groups."""
    llm = LLM(smollm2, **ARGS)
    try:
        return {tuple(p): out.outputs[0].token_ids
                for p, out in zip(UNRELATED + _group_prompts(),
                                  llm.generate(UNRELATED + _group_prompts(), GREEDY,
                                               use_tqdm=False))}
    finally:
        llm.shutdown()


def _group_prompts(groups: int = 4, per_group: int = 4, shared: int = 256) -> list[list[int]]:
    """groups x per_group prompts: each group's share `shared` tokens (16 blocks), then 16 of
    their own."""
    prompts = []
    for g in range(groups):
        prefix = [(1000 + 131 * g + 7 * j) % 40000 + 50 for j in range(shared)]
        prompts += [prefix + [20000 + 100 * g + 10 * i + j for j in range(16)]
                    for i in range(per_group)]
    return prompts


async def _run(client, prompt, params=GREEDY, request_id=None):
    """(replica index, final output) of one request."""
    request_id = request_id or os.urandom(8).hex()
    replica, last = None, None
    async for out in client.generate(prompt, params, request_id):
        replica, last = client.replica_of(request_id), out
    return replica, last


def _replica_pids(client) -> list[int]:
    """Every replica's core process and its workers."""
    pids = []
    for link in client.links:
        replica = link.replica
        pid = replica.proc.pid if hasattr(replica, "proc") else replica.info["pid"]
        pids += [pid, *child_pids(pid)]
    return pids


def _kill_replica(client, index: int) -> None:
    replica = client.links[index].replica
    if hasattr(replica, "actor"):
        import ray

        ray.kill(replica.actor, no_restart=False)  # Ray restarts it
    else:
        os.kill(replica.proc.pid, signal.SIGKILL)


def test_two_replicas_serve_one_engines_tokens_and_route_by_prefix(smollm2, backend_args,
                                                                   expected):
    groups = _group_prompts()

    async def group(client, prompts):
        first = await _run(client, prompts[0])
        rest = await asyncio.gather(*(_run(client, p) for p in prompts[1:]))
        return [first, *rest]

    async def main():
        async with AsyncClient(smollm2, data_parallel_size=2, **backend_args,
                               **ARGS) as client:
            unrelated = await asyncio.gather(*(_run(client, p) for p in UNRELATED))
            grouped = await asyncio.gather(*(group(client, groups[i:i + 4])
                                             for i in range(0, len(groups), 4)))
            pids = _replica_pids(client)
        return unrelated, grouped, pids

    unrelated, grouped, pids = asyncio.run(asyncio.wait_for(main(), 300))
    for prompt, (_, out) in zip(UNRELATED + groups, unrelated + sum(grouped, [])):
        assert out.outputs[0].token_ids == expected[tuple(prompt)]
    spread = [replica for replica, _ in unrelated]
    assert sorted(set(spread)) == [0, 1] and abs(spread.count(0) - spread.count(1)) <= 2, spread
    for results in grouped:
        first_replica = results[0][0]
        assert [replica for replica, _ in results] == [first_replica] * 4
        later = [out for _, out in results[1:]]
        hit_rate = sum(o.num_cached_tokens for o in later) / sum(len(o.prompt_token_ids)
                                                                 for o in later)
        assert hit_rate >= 0.9, hit_rate
    assert wait_gone(pids, 15) == []


def test_a_killed_replica_fails_its_requests_and_serves_again(smollm2, backend_args,
                                                              expected):
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)

    async def drain(client, prompt, request_id):
        try:
            return await _run(client, prompt, long, request_id)
        except EngineDeadError as e:
            return e

    async def main():
        async with AsyncClient(smollm2, data_parallel_size=2, router_policy="round_robin",
                               **backend_args, **ARGS) as client:
            tasks = [asyncio.create_task(drain(client, p, f"long-{i}"))
                     for i, p in enumerate(UNRELATED[:4])]
            while len(client.request_replica) < 4:
                await asyncio.sleep(0.05)
            turns = [client.replica_of(f"long-{i}") for i in range(4)]
            on_one = [t for t, replica in zip(tasks, turns) if replica == 1]
            await asyncio.sleep(1.0)  # they are decoding
            killed = _replica_pids(client)
            _kill_replica(client, 1)
            failed = await asyncio.wait_for(asyncio.gather(*on_one), 30)
            states = client.replica_states()
            healthy = await client.health()
            # the other replica keeps serving meanwhile (both routed at once: a replica Ray
            # restarts may be back within the second of the first's decode)
            during = await asyncio.gather(*(_run(client, p) for p in UNRELATED[4:6]))
            deadline = time.monotonic() + RESTART_WITHIN_S
            while client.replica_states()[1] != "serving":
                assert time.monotonic() < deadline, client.replica_states()
                await asyncio.sleep(0.2)
            after = [await _run(client, p) for p in UNRELATED[6:8]]
            survivors = await asyncio.gather(*(t for t in tasks if t not in on_one))
            pids = _replica_pids(client)
        return turns, failed, states, healthy, during, after, survivors, killed, pids

    turns, failed, states, healthy, during, after, survivors, killed, pids = asyncio.run(
        asyncio.wait_for(main(), 300))
    assert turns == [0, 1, 0, 1]  # round-robin alternates
    assert len(failed) == 2 and all(isinstance(e, EngineDeadError) for e in failed), failed
    assert states[0] == "serving" and states[1] in ("restarting", "down") and healthy
    assert [replica for replica, _ in during] == [0, 0]
    assert sorted(replica for replica, _ in after) == [0, 1]  # replica 1 is back in turn
    for prompt, (_, out) in zip(UNRELATED[4:8], during + after):
        assert out.outputs[0].token_ids == expected[tuple(prompt)]
    assert all(len(out.outputs[0].token_ids) == 150 for _, out in survivors)
    assert wait_gone(killed + pids, 15) == []


def test_offline_llm_spreads_a_batch_over_replicas(smollm2, offline_backend_args, expected):
    llm = LLM(smollm2, data_parallel_size=2, **offline_backend_args, **ARGS)
    try:
        prompts = UNRELATED + _group_prompts()
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        in_flight = llm.client.router.in_flight
        queried = [msgspec.convert(llm.client.utility("stats", replica),
                                   SchedulerStats).prefix_cache_queries for replica in (0, 1)]
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in prompts]
    assert in_flight == [0, 0]  # every request finished on the replica it was routed to
    assert min(queried) > 0, queried  # both replicas took prompts
