"""Tensor parallelism on CPU with gloo: 2 ranks compute the logits 1 rank computes (and that
transformers computes) on Qwen3 and Llama, including one KV head replicated on both ranks and a
vocabulary that does not split evenly; greedy tokens are the same. Plus each layer's slice of
the checkpoint, rank by rank, without processes."""

import multiprocessing
import time
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch

from echo.distributed.parallel_state import TPGroup
from echo.layers.embedding import ParallelLMHead
from echo.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from tests.distributed import tp_peers
from tests.helpers import load_hf

PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 40)), [1] + [7, 8, 9] * 9, [1, 2]]
MAX_NEW_TOKENS = 6
TP2_MODELS = ["tiny_qwen3", "tiny_llama", "tiny_qwen3_kv1", "tiny_llama_kv1_odd_vocab"]
RANKS_TIMEOUT = 120.0  # seconds for the whole group; far above the ~10 s it takes


def run_ranks(world_size: int, folders: dict[str, Path], out_dir: Path) -> dict[str, list]:
    """Run every model on `world_size` spawned gloo ranks; {name: [rank 0 result, ...]}.
    Every process started here is ended here, by its own handle."""
    context = multiprocessing.get_context("spawn")
    jobs = [(name, str(folder)) for name, folder in folders.items()]
    processes = [context.Process(target=tp_peers.run_rank, daemon=True,
                                 args=(rank, world_size, str(out_dir / "rendezvous"), jobs,
                                       PROMPTS, MAX_NEW_TOKENS, str(out_dir)))
                 for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + RANKS_TIMEOUT
        running = processes
        # stop at the first failure: its peers would otherwise wait in a collective until
        # gloo's timeout
        while running and time.monotonic() < deadline:
            wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
            running = [p for p in processes if p.exitcode is None]
            if any(p.exitcode for p in processes):
                break
    finally:
        for process in processes:
            if process.exitcode is None:
                process.kill()
            process.join(timeout=5)
    errors = sorted(out_dir.glob("rank*.error"))
    if errors or any(p.exitcode != 0 for p in processes):
        details = "\n".join(e.read_text() for e in errors)
        pytest.fail(f"rank exit codes {[p.exitcode for p in processes]}\n{details}")
    return {name: [torch.load(out_dir / f"{name}.rank{rank}.pt")
                   for rank in range(world_size)] for name in folders}


def sequence_rows(result: dict, index: int) -> torch.Tensor:
    """Sequence `index`'s logits over all steps: its prompt's rows from the prefill step, then
    one row per decode step."""
    start = sum(len(p) for p in PROMPTS[:index])
    prefill = result["logits"][0][start:start + len(PROMPTS[index])]
    return torch.cat([prefill, *(step[index:index + 1] for step in result["logits"][1:])])


def hf_rows(hf, index: int, generated: list[int]) -> torch.Tensor:
    """transformers' logits over the same tokens echo computed: prompt + all but the last."""
    with torch.no_grad():
        return hf(torch.tensor([PROMPTS[index] + generated[:-1]])).logits[0]


def assert_matches_single_rank(ranks: list[dict], single: dict, folder: Path) -> None:
    # every rank gathers the whole vocabulary: identical bits, so every rank samples the same
    # token without talking to the others
    for other in ranks[1:]:
        for got, expected in zip(other["logits"], ranks[0]["logits"]):
            assert torch.equal(got, expected)
    tp = ranks[0]
    scale = max(step.abs().max().item() for step in single["logits"])
    # summing partial products across ranks reorders float32 additions: a few ulps of the scale
    tolerance = dict(atol=1e-4 * scale, rtol=1e-4)
    for got, expected in zip(tp["logits"], single["logits"]):
        assert got.shape == expected.shape  # padded vocabulary rows are cut off
        torch.testing.assert_close(got, expected, **tolerance)
    assert tp["tokens"] == single["tokens"]
    hf = load_hf(folder)
    for index, generated in enumerate(tp["tokens"]):
        torch.testing.assert_close(sequence_rows(tp, index), hf_rows(hf, index, generated),
                                   **tolerance)


@pytest.fixture(scope="module")
def tp2_results(request, tmp_path_factory):
    folders = {name: request.getfixturevalue(name) for name in TP2_MODELS}
    folders["tiny_qwen3:reduce_in_norm"] = folders["tiny_qwen3"]
    return run_ranks(2, folders, tmp_path_factory.mktemp("tp2"))


@pytest.mark.parametrize("name", TP2_MODELS)
def test_tp2_logits_and_greedy_tokens_match_one_rank_and_transformers(name, tp2_results,
                                                                      request):
    folder = request.getfixturevalue(name)
    single = tp_peers.run_single(folder, PROMPTS, MAX_NEW_TOKENS)
    assert_matches_single_rank(tp2_results[name], single, folder)


def test_tp2_with_the_all_reduces_in_the_norms_matches_one_rank(tiny_qwen3, tp2_results):
    # o_proj and down_proj leave partial sums; each RMSNorm after them (and the final one)
    # reduces them first: the same logits as one rank
    assert_matches_single_rank(tp2_results["tiny_qwen3:reduce_in_norm"],
                               tp_peers.run_single(tiny_qwen3, PROMPTS, MAX_NEW_TOKENS),
                               tiny_qwen3)


def test_norm_reduces_only_on_several_ranks_without_row_parallel_bias(tiny_qwen3):
    from dataclasses import replace

    from echo.config import EngineConfig
    from echo.distributed.parallel_state import TPGroup
    from echo.models.llama import norm_reduces

    arch = EngineConfig.create(str(tiny_qwen3), device="cpu").model.arch
    on = TPGroup(0, 2, reduce_in_norm=True)
    assert norm_reduces(arch, on)
    assert not norm_reduces(arch, TPGroup(0, 2))
    assert not norm_reduces(arch, TPGroup(0, 1, reduce_in_norm=True))
    assert not norm_reduces(replace(arch, attention_bias=True), on)
    assert not norm_reduces(replace(arch, mlp_bias=True), on)


def test_tp4_replicates_each_of_two_kv_heads_on_two_ranks(tiny_llama, tmp_path):
    """4 heads, 2 KV heads, 4 ranks: ranks 0-1 share KV head 0 and ranks 2-3 KV head 1."""
    ranks = run_ranks(4, {"tiny_llama": tiny_llama}, tmp_path)["tiny_llama"]
    single = tp_peers.run_single(tiny_llama, PROMPTS, MAX_NEW_TOKENS)
    assert_matches_single_rank(ranks, single, tiny_llama)


# ---- each rank's slice of the checkpoint (no collectives needed to load) -------------------


def test_merged_column_rank_holds_its_slice_of_each_part():
    gate, up = torch.randn(6, 4), torch.randn(10, 4)
    for rank in range(2):
        layer = MergedColumnParallelLinear(4, [6, 10], tp=TPGroup(rank, 2))
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        expected = torch.cat([gate[3 * rank:3 * rank + 3], up[5 * rank:5 * rank + 5]])
        assert torch.equal(layer.weight, expected)


def test_merged_column_refuses_a_part_that_does_not_split():
    # 3 + 5 = 8 splits in two, but neither part does: the loader would mislay rows
    with pytest.raises(ValueError, match=r"output size \(3\).*tensor_parallel_size \(2\)"):
        MergedColumnParallelLinear(4, [3, 5], tp=TPGroup(0, 2))


def test_qkv_ranks_share_kv_heads_in_order():
    head_dim, hidden = 2, 8
    q, k, v = torch.randn(8 * head_dim, hidden), torch.randn(2 * head_dim, hidden), \
        torch.randn(2 * head_dim, hidden)
    for rank in range(4):
        layer = QKVParallelLinear(hidden, head_dim, 8, 2, tp=TPGroup(rank, 4))
        for shard_id, weight in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, weight, shard_id)
        kv_head = rank // 2
        heads = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        expected = torch.cat([q[2 * rank * head_dim:2 * (rank + 1) * head_dim], k[heads],
                              v[heads]])
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        assert torch.equal(layer.weight, expected)


def test_qkv_refuses_tp_that_is_not_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\).*num_key_value_heads "
                                         r"\(3\)"):
        QKVParallelLinear(8, 2, 12, 3, tp=TPGroup(0, 4))


def test_lm_head_pads_the_last_rank_of_an_uneven_vocabulary():
    full = torch.randn(127, 4)
    shards = []
    for rank in range(2):
        head = ParallelLMHead(127, 4, TPGroup(rank, 2))
        head.weight.weight_loader(head.weight, full)
        shards.append(head.weight.detach())
    assert shards[1].shape == (64, 4) and torch.equal(shards[1][-1], torch.zeros(4))
    assert torch.equal(torch.cat(shards)[:127], full)


def test_a_rank_reads_only_its_slices_from_the_checkpoint(tiny_llama_kv1_odd_vocab, monkeypatch):
    """Loading rank 0 of 2 reads about half the checkpoint's elements (norms are whole on every
    rank), and its weights equal the slices of the fully read tensors."""
    from echo.config import EngineConfig
    from echo.layers.checkpoint_tensor import CheckpointTensor
    from echo.worker.model_loader import build_model

    read = []  # elements of every read from a checkpoint file

    class CountingSlice:
        def __init__(self, checkpoint_slice):
            self.inner = checkpoint_slice

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            out = self.inner[index]
            read.append(out.numel())
            return out

    init = CheckpointTensor.__init__
    monkeypatch.setattr(CheckpointTensor, "__init__",
                        lambda self, sl: init(self, CountingSlice(sl)))
    config = EngineConfig.create(str(tiny_llama_kv1_odd_vocab), device="cpu")
    full = build_model(config.model, torch.device("cpu"))
    full_elements, read[:] = sum(read), []
    rank0 = build_model(config.model, torch.device("cpu"), TPGroup(0, 2))
    assert 0.45 * full_elements < sum(read) < 0.6 * full_elements
    down = rank0.model.layers[0].mlp.down_proj.weight  # row-parallel: the first half of K
    assert torch.equal(down, full.model.layers[0].mlp.down_proj.weight[:, : down.shape[1]])
