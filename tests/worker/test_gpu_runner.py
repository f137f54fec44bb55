"""The GPU path (triton backend, CUDA graphs) against transformers and against eager mode."""

import pytest
import torch

from echo import LLM, SamplingParams
from tests.entrypoints.test_llm import PROMPTS
from tests.helpers import load_hf
from tests.models.test_logits_vs_transformers import assert_prefill_logits_match, prefill_output

pytestmark = pytest.mark.gpu


def gpu_llm(folder, **kwargs) -> LLM:
    kwargs = {"device": "cuda", "dtype": "float32", "num_gpu_blocks_override": 256,
              "max_num_seqs": 16, "max_model_len": 512, **kwargs}
    return LLM(str(folder), **kwargs)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_triton_prefill_logits_match_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    llm = gpu_llm(folder, enforce_eager=True)
    runner = llm.engine.executor.runner
    assert runner.backend.name == "triton"
    out = prefill_output(PROMPTS)
    runner.input_batch.update(out, runner.vocab_size)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.forward(runner.input_batch.prepare(out)))
    assert_prefill_logits_match(logits, load_hf(folder), PROMPTS, tolerance=2e-2)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_greedy_with_cuda_graphs_equals_eager_and_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    graphs = gpu_llm(folder).generate(PROMPTS, params, use_tqdm=False)
    eager = gpu_llm(folder, enforce_eager=True).generate(PROMPTS, params, use_tqdm=False)
    assert gpu_llm(folder).engine.executor.runner.graphs is not None
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
    hf = load_hf(folder)
    hf.generation_config.eos_token_id = None
    agree = 0
    for prompt, out in zip(PROMPTS, graphs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        agree += out.outputs[0].token_ids == ref
    # tf32 attention may flip a near-tie in one continuation of a random model, not in most
    assert agree >= len(PROMPTS) - 1


def test_bf16_dummy_qwen3_runs_mixed_batches_with_graphs():
    llm = LLM("qwen3-0.6b", load_format="dummy", device="cuda", max_model_len=1024,
              max_num_seqs=32, max_num_batched_tokens=512)
    prompts = [[(7 * i + j) % 1000 for j in range(20 + 37 * i)] for i in range(24)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=40, seed=3,
                                                ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.stats().num_running == 0


def test_pdl_gives_the_same_tokens(tiny_qwen3, monkeypatch):
    # PDL (on by default): echo's kernels start while the previous one finishes, inside and
    # outside CUDA graphs; a missing wait would let a kernel read a stale input
    from echo_kernels.pdl import use_pdl

    def generate(pdl: str):
        monkeypatch.setenv("ECHO_PDL", pdl)
        use_pdl.cache_clear()
        try:
            assert use_pdl(torch.device("cuda")) == (pdl == "1")
            return gpu_llm(tiny_qwen3).generate(PROMPTS, params, use_tqdm=False)
        finally:
            use_pdl.cache_clear()

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = generate("0")
    pdl = generate("1")
    assert [o.outputs[0].token_ids for o in pdl] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("steps", [1, 8])
def test_step_copies_by_kernel_give_the_same_tokens(tiny_qwen3, monkeypatch, steps):
    # the step's inputs, sampling parameters and sampled tokens moved by kernels through
    # pinned memory (ECHO_STEP_COPIES=kernel), graphs and several steps a launch included;
    # sampled with a temperature and seeds, so every sampling input matters
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=5, max_tokens=24,
                             ignore_eos=True, logprobs=2)]

    def generate(mode: str):
        monkeypatch.setenv("ECHO_STEP_COPIES", mode)
        llm = gpu_llm(tiny_qwen3, num_scheduler_steps=steps)
        try:
            return [[(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(PROMPTS, p, use_tqdm=False)] for p in params]
        finally:
            llm.shutdown()

    assert generate("kernel") == generate("engine")


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_several_decode_steps_per_launch_with_graphs_equal_one_step(fixture, request):
    """num_scheduler_steps: the sampling graphs replayed over the forward graphs, and the same
    steps eagerly, give the tokens of one step per launch (greedy and seeded), over batch
    sizes that pad to a captured size."""
    folder = request.getfixturevalue(fixture)
    params = [SamplingParams(temperature=0, max_tokens=29, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=37, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=11, ignore_eos=True)]

    def tokens(**kwargs):
        llm = gpu_llm(folder, **kwargs)
        try:
            outputs = llm.generate(PROMPTS, [params[i % 3] for i in range(len(PROMPTS))],
                                   use_tqdm=False)
            assert llm.engine.scheduler.kv.usage == 0
            return [o.outputs[0].token_ids for o in outputs], llm.engine.executor.runner
        finally:
            llm.shutdown()

    expected, _ = tokens()
    graphs, runner = tokens(num_scheduler_steps=8)
    assert runner.multi_step.sample_graphs  # sampling ran inside captured graphs
    eager, _ = tokens(num_scheduler_steps=8, enforce_eager=True)
    assert graphs == expected and eager == expected


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_verification_graphs_of_one_plus_k_tokens_equal_eager_and_no_speculation(
        fixture, request, tmp_path):
    """Decodes verifying k drafts each replay the graphs captured for 1 + k query tokens; the
    greedy tokens equal eager verification's and those without speculation (the oracle drafts
    the run's own continuations, right with probability 0.7)."""
    from echo.core.oracle_proposer import save_continuations

    folder = request.getfixturevalue(fixture)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = gpu_llm(folder)
    try:
        expected = plain.generate(PROMPTS, greedy, use_tqdm=False)
    finally:
        plain.shutdown()
    path = tmp_path / "oracle.json"
    save_continuations(path, {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids)
                              for o in expected})
    spec = {"method": "oracle", "num_speculative_tokens": 3, "oracle_path": str(path),
            "oracle_acceptance": 0.7}

    def tokens(**kwargs):
        llm = gpu_llm(folder, speculative_config=spec, **kwargs)
        try:
            graphs, replayed = llm.engine.executor.runner.graphs, []
            if graphs is not None:
                replay = graphs.replay
                graphs.replay = lambda bs, q=1: replayed.append(q) or replay(bs, q)
            outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
            assert llm.engine.scheduler.kv.usage == 0
            assert llm.stats().spec_num_accepted_tokens > 0
            return [o.outputs[0].token_ids for o in outputs], replayed
        finally:
            llm.shutdown()

    with_graphs, replayed = tokens()
    assert 4 in replayed  # uniform verification batches ran as graphs
    eager, _ = tokens(enforce_eager=True)
    want = [o.outputs[0].token_ids for o in expected]
    assert with_graphs == want and eager == want


def test_draft_model_with_graphs_equals_eager_and_no_speculation(tiny_llama, tmp_path):
    """speculative method draft_model on the GPU: the draft follows every step through graphs
    of the target's shapes and proposes through its own decode and sampling graphs; greedy
    tokens equal eager and no speculation, and the target itself as draft is accepted."""
    from tests.helpers import write_tiny_model

    draft = write_tiny_model(tmp_path / "draft", "qwen3", tie=True, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def tokens(spec=None, **kwargs):
        llm = gpu_llm(tiny_llama, speculative_config=spec, **kwargs)
        try:
            outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
            assert llm.engine.scheduler.kv.usage == 0
            return [o.outputs[0].token_ids for o in outputs], llm.stats()
        finally:
            llm.shutdown()

    expected, _ = tokens()
    for model in (draft, tiny_llama):
        spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
        graphs, stats = tokens(spec)
        eager, _ = tokens(spec, enforce_eager=True)
        assert graphs == expected and eager == expected and stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens  # itself


def test_eagle3_head_steps_replay_graphs_and_equal_no_speculation(tmp_path):
    """speculative method eagle3 on the GPU: the head's k - 1 decode steps replay its own
    graphs (and sampling graphs), the target's verification graphs keep the hidden states the
    head reads; greedy tokens equal eager and no speculation."""
    from tests.helpers import write_tiny_model
    from tests.models.test_eagle3 import write_head

    target = write_tiny_model(tmp_path / "target", "llama", tie=False, num_layers=6)
    write_head(tmp_path / "head")
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}

    def tokens(spec=None, **kwargs):
        llm = gpu_llm(target, speculative_config=spec, **kwargs)
        try:
            drafter, replayed = llm.engine.executor.runner.drafter, []
            if drafter is not None and drafter.graphs is not None:
                replay = drafter.graphs.replay
                drafter.graphs.replay = lambda bs, q=1: replayed.append(bs) or replay(bs, q)
            outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
            assert llm.engine.scheduler.kv.usage == 0
            return [o.outputs[0].token_ids for o in outputs], llm.stats(), replayed
        finally:
            llm.shutdown()

    expected, _, _ = tokens()
    graphs, stats, replayed = tokens(spec)
    eager, _, _ = tokens(spec, enforce_eager=True)
    assert replayed and stats.spec_num_drafts > 0
    assert graphs == expected and eager == expected
