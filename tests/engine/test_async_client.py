"""AsyncClient against a real EngineCore process and worker process (CPU, tiny model)."""

import asyncio
import os

import pytest

from echo import LLM, SamplingParams
from echo.engine.async_client import AsyncClient, EngineDeadError
from tests.entrypoints.test_llm import PROMPTS

ENGINE_ARGS = {"device": "cpu", "num_gpu_blocks_override": 128, "max_num_seqs": 8,
               "max_model_len": 256}


def run(coro):
    return asyncio.run(coro)


async def collect(client, prompt, params, request_id=None):
    outputs = [out async for out in client.generate(prompt, params, request_id)]
    return outputs


def test_concurrent_streams_equal_offline_llm(tiny_qwen3):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = LLM(str(tiny_qwen3), **ENGINE_ARGS).generate(PROMPTS, params, use_tqdm=False)

    async def main():
        async with AsyncClient(str(tiny_qwen3), **ENGINE_ARGS) as client:
            streams = await asyncio.gather(*(collect(client, p, params) for p in PROMPTS))
            stats = await client.stats()
            return streams, stats

    streams, stats = run(main())
    for stream, ref in zip(streams, expected):
        final = stream[-1].outputs[0]
        assert final.token_ids == ref.outputs[0].token_ids
        # deltas add up to the whole, and only the last output is finished
        assert sum((o.outputs[0].delta_token_ids for o in stream), []) == final.token_ids
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        assert final.finish_reason == "length"
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_leaving_the_stream_early_aborts_the_request(tiny_llama):
    async def main():
        async with AsyncClient(str(tiny_llama), **ENGINE_ARGS) as client:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            seen = 0
            async for _ in client.generate(PROMPTS[0], params, request_id="early"):
                seen += 1
                if seen == 3:
                    break
            for _ in range(50):  # the abort reaches the core asynchronously
                stats = await client.stats()
                if stats.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            # the engine keeps serving
            more = await collect(client, PROMPTS[1], SamplingParams(max_tokens=3,
                                                                     ignore_eos=True))
            return stats, more

    stats, more = run(main())
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert len(more[-1].outputs[0].token_ids) == 3


def test_refused_requests_raise_and_others_continue(tiny_llama):
    # 8 blocks of 16 tokens: a 150-token prompt passes the frontend (max_model_len 256) but
    # can never fit in the KV cache, so the core refuses it
    args = {**ENGINE_ARGS, "num_gpu_blocks_override": 8}

    async def main():
        async with AsyncClient(str(tiny_llama), **args) as client:
            with pytest.raises(ValueError, match="max_model_len"):
                await collect(client, [5] * 300, SamplingParams(max_tokens=2))
            with pytest.raises(ValueError, match="KV|block"):
                await collect(client, [5] * 150, SamplingParams(max_tokens=2))
            with pytest.raises(ValueError, match="sampling_params: expected a SamplingParams"):
                await collect(client, PROMPTS[0], {"max_tokens": 2})
            return await collect(client, PROMPTS[0], SamplingParams(max_tokens=2,
                                                                    ignore_eos=True))

    assert len(run(main())[-1].outputs[0].token_ids) == 2


def test_dead_engine_fails_pending_requests_instead_of_hanging(tiny_llama):
    async def main():
        async with AsyncClient(str(tiny_llama), **ENGINE_ARGS) as client:
            params = SamplingParams(temperature=0, max_tokens=100_000 // 1000, ignore_eos=True)
            stream = client.generate(PROMPTS[0], params)
            await stream.__anext__()
            os.kill(client.proc.pid, 9)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert not await client.health()

    run(asyncio.wait_for(main(), 60))


def test_engine_start_failure_reports_the_error(tmp_path):
    import shutil

    from tests.helpers import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", "llama", tie=True)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="safetensors"):
        run(AsyncClient(str(folder), **ENGINE_ARGS).start())
    shutil.rmtree(folder)
