"""The KV cache's host tier end to end on CPU (torch backend, SmolLM2): multi-turn conversations
whose histories exceed a tiny GPU pool give the same greedy tokens with offload on and off,
through chunked prefill after loaded blocks; prefixes evicted from the GPU are loaded, not
recomputed (counters); after a run with random aborts both tiers account for every block."""

import random

import pytest

from echo import LLM, SamplingParams
from echo.config import EngineConfig
from echo.engine.core import EngineCore
from echo.engine.messages import EngineCoreRequest
from tests.helpers import VOCAB

# 40 blocks of 16 tokens: four conversations of ~330 tokens do not fit at once; chunks of 64
ARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4,
        "max_num_batched_tokens": 64, "num_gpu_blocks_override": 40}
OFFLOAD_GIB = 0.2  # ~290 host blocks of SmolLM2 (737 KB each in float32)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2():
    from echo.models.default_model import ensure_default_model

    return str(ensure_default_model())


def conversations(turns: int = 4, num: int = 4, vocab: int = 9200) -> list[list[list[int]]]:
    """num conversations of `turns` user messages (token ids below vocab): a shared 96-token
    system prompt, then 40 tokens of each user turn."""
    system = [((17 * j) % 4000 + 100) % vocab for j in range(96)]
    return [[system] + [[((131 * c + 7 * t + j) % 9000 + 200) % vocab for j in range(40)]
                        for t in range(turns)] for c in range(num)]


def run_conversations(model: str, vocab: int = 9200, **extra) -> tuple[list[list[int]], object]:
    """Every conversation's turns, interleaved (turn t of all, then t + 1): the outputs of
    each turn, and the engine's stats at the end."""
    llm = LLM(model, **{**ARGS, **extra})
    try:
        chats = conversations(vocab=vocab)
        histories = [chat[0] for chat in chats]
        outputs = []
        for turn in range(1, len(chats[0])):
            prompts = [h + chat[turn] for h, chat in zip(histories, chats)]
            results = llm.generate(prompts, GREEDY, use_tqdm=False)
            tokens = [r.outputs[0].token_ids for r in results]
            outputs += tokens
            histories = [p + t for p, t in zip(prompts, tokens)]
        return outputs, llm.stats()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def without_offload(smollm2):
    return run_conversations(smollm2)


@pytest.fixture(scope="module")
def write_through(smollm2):
    return run_conversations(smollm2, kv_offloading_size=OFFLOAD_GIB)


def test_multi_turn_greedy_tokens_equal_with_offload_on_and_off(without_offload,
                                                                  write_through):
    off, off_stats = without_offload
    on, on_stats = write_through
    assert on == off
    # the histories did not fit: without the host tier later turns recomputed prefixes ...
    assert off_stats.kv_loaded_blocks == 0
    # ... which the host tier loaded instead
    assert on_stats.kv_stored_blocks > 0 and on_stats.kv_loaded_blocks > 0
    assert on_stats.kv_host_hits == on_stats.kv_loaded_blocks * 16
    # SmolLM2 in float32: 30 layers x K and V x 16 tokens x 3 KV heads x 64 x 4 bytes a block
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4
    assert on_stats.kv_stored_bytes == on_stats.kv_stored_blocks * block_bytes
    assert on_stats.kv_loaded_bytes == on_stats.kv_loaded_blocks * block_bytes
    assert on_stats.kv_transfer_seconds > 0
    # each load is one request's: at least one request loaded, none loaded twice
    assert 0 < on_stats.kv_loads <= on_stats.kv_loaded_blocks
    assert on_stats.kv_load_wait_seconds > 0
    assert on_stats.prefix_cache_hits > off_stats.prefix_cache_hits


def test_write_back_gives_the_same_tokens_and_stores_only_what_the_gpu_evicts(
        smollm2, without_offload, write_through):
    """Write-back stores a block only when an allocation evicts it: a subset of what
    write-through stores (every finished request's full blocks), short of the blocks still
    cached on the GPU at the end; histories still come back from the host."""
    off, _ = without_offload
    _, through = write_through
    on, back = run_conversations(smollm2, kv_offloading_size=OFFLOAD_GIB,
                                 kv_offloading_policy="write_back")
    assert on == off
    assert 0 < back.kv_stored_blocks < through.kv_stored_blocks
    assert back.kv_loaded_blocks > 0


@pytest.mark.parametrize("policy, copy_mode", [("write_through", "staged"),
                                               ("write_back", "direct")])
def test_random_aborts_leave_both_tiers_accounted(tiny_llama, policy, copy_mode, monkeypatch):
    monkeypatch.setenv("ECHO_KV_COPY_MODE", copy_mode)  # the workers' KVTransfers read it
    config = EngineConfig.create(str(tiny_llama), kv_offloading_size=0.01,
                                 preemption_mode="swap", kv_offloading_policy=policy, **ARGS)
    engine = EngineCore(config)
    rng = random.Random(0)
    chats = conversations(turns=2, num=8, vocab=VOCAB)
    prompts = [chat[0] + chat[1] for chat in chats] + [chat[0] + chat[2] for chat in chats]
    try:
        live: set[str] = set()
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(
                temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True)))
            live.add(f"r{i}")
        steps = 0
        while engine.has_work():
            outputs = engine.step_overlapped()
            steps += 1
            for out in outputs.outputs if outputs else []:
                if out.finish_reason is not None:
                    live.discard(out.request_id)
            if live and rng.random() < 0.15:  # abort one, at any point of its life
                victim = rng.choice(sorted(live))
                engine.abort_requests([victim])
                live.discard(victim)
            assert steps < 5000
        kv = engine.scheduler.kv
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks  # nothing is held once all is done
        assert not kv.transfers_pending
        assert kv.stored_blocks > 0
    finally:
        engine.shutdown()


def test_bad_offload_arguments_name_their_field(smollm2):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig.create(smollm2, device="cpu", kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig.create(smollm2, device="cpu", kv_offloading_size=1,
                            enable_prefix_caching=False)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig.create(smollm2, device="cpu", preemption_mode="swap")
    with pytest.raises(ValueError, match="kv_offloading_policy"):
        EngineConfig.create(smollm2, device="cpu", kv_offloading_policy="write_back")
    with pytest.raises(ValueError, match="kv_offloading_policy"):
        EngineConfig.create(smollm2, device="cpu", kv_offloading_size=1,
                            kv_offloading_policy="lazy")


@pytest.mark.parametrize("early_loads", ["0", "1"])
def test_two_ranks_move_their_own_shards(tiny_llama, early_loads, monkeypatch):
    """TP=2 (gloo, worker processes): each rank stores and loads its half of every block; the
    tokens equal one rank's without offload, and only rank 0's report reaches the core. With
    early loads, each rank's step waits for its own shard of a joined load."""
    args = {"tensor_parallel_size": 2, "vocab": VOCAB}
    off, _ = run_conversations(str(tiny_llama), **args)
    monkeypatch.setenv("ECHO_KV_EARLY_LOADS", early_loads)
    on, stats = run_conversations(str(tiny_llama), kv_offloading_size=0.01, **args)
    assert on == off
    assert stats.kv_loaded_blocks > 0
    assert (stats.kv_loads_joined > 0) == (early_loads == "1")


def test_early_loads_give_the_same_tokens_and_admit_some_requests_with_their_loads(
        smollm2, without_offload, monkeypatch):
    """ECHO_KV_EARLY_LOADS: loads into blocks no step in flight uses start at once and, when
    small, their requests run in the step that carries them (joined); the tokens stay those of
    the run without the tier."""
    off, _ = without_offload
    monkeypatch.setenv("ECHO_KV_EARLY_LOADS", "1")
    on, stats = run_conversations(smollm2, kv_offloading_size=OFFLOAD_GIB)
    assert on == off
    assert 0 < stats.kv_loads_joined <= stats.kv_loads
    assert stats.kv_loaded_blocks > 0
