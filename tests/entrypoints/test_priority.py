"""A request's priority through the OpenAI server and echo.LLM to the scheduler, and refused
under the default fcfs policy (as vLLM refuses it)."""

import asyncio

import pytest

from echo import LLM, SamplingParams
from tests.entrypoints import test_api_server
from tests.entrypoints.test_api_server import with_server

ONE_SEAT = {"device": "cpu", "num_gpu_blocks_override": 256, "max_num_seqs": 1,
            "max_model_len": 1024}


async def wait_for_stats(client, check, timeout_s: float = 30.0):
    for _ in range(int(timeout_s / 0.01)):
        if check(await client.stats()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"stats never matched: {await client.stats()}")


def test_the_lower_priority_value_is_served_first_over_http(tiny_chat_model, monkeypatch):
    monkeypatch.setattr(test_api_server, "ENGINE_ARGS",
                        {**ONE_SEAT, "scheduling_policy": "priority"})

    async def test(http, client):
        finished = []

        async def post(name: str, priority: int, chat: bool):
            body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "priority": priority}
            if chat:
                r = await http.post("/v1/chat/completions", json={
                    **body, "messages": [{"role": "user", "content": name}]})
            else:
                r = await http.post("/v1/completions", json={**body, "prompt": name})
            assert r.status_code == 200, r.text
            finished.append(name)

        # the only seat is taken until the two requests below are both waiting
        blocker = client.generate("a long story", SamplingParams(max_tokens=1000,
                                                                 ignore_eos=True))
        await anext(blocker)
        low = asyncio.create_task(post("low", 5, chat=False))
        await wait_for_stats(client, lambda s: s.num_waiting == 1)
        high = asyncio.create_task(post("high", -1, chat=True))  # queued after low
        await wait_for_stats(client, lambda s: s.num_waiting == 2 and s.num_running == 1)
        await blocker.aclose()  # aborts it: the seat goes to the best waiting request
        await asyncio.gather(low, high)
        return finished

    assert with_server(tiny_chat_model, test) == ["high", "low"]


def test_fcfs_server_refuses_a_priority_naming_the_field(tiny_chat_model):
    async def test(http, client):
        plain = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                          "priority": 3})
        streamed = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "stream": True,
            "priority": -1})
        zero = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                         "priority": 0})
        return plain, streamed, zero

    plain, streamed, zero = with_server(tiny_chat_model, test)
    for r in (plain, streamed):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "priority" and "scheduling_policy" in error["message"]
    assert zero.status_code == 200, zero.text


def test_llm_generate_takes_one_priority_per_prompt(tiny_chat_model):
    prompts = ["one", "two", "three"]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    fcfs = LLM(str(tiny_chat_model), **ONE_SEAT)
    try:
        expected = [o.outputs[0].token_ids for o in fcfs.generate(prompts, params,
                                                                  use_tqdm=False)]
        with pytest.raises(ValueError, match=r"^priority: 2 given, but the engine schedules"):
            fcfs.generate(prompts, params, use_tqdm=False, priority=[0, 2, 0])
        assert not fcfs.engine.scheduler.has_unfinished_requests()  # nothing was queued
    finally:
        fcfs.shutdown()

    llm = LLM(str(tiny_chat_model), scheduling_policy="priority", **ONE_SEAT)
    try:
        with pytest.raises(ValueError, match=r"^priority: 2 given for 3 prompts"):
            llm.generate(prompts, params, use_tqdm=False, priority=[1, 2])
        outputs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 1, 2])
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected  # in prompt order
    # one seat, all queued at once: served by priority, so each waited for those before it
    waited = [o.queue_time for o in outputs]
    assert waited[1] < waited[2] < waited[0]
