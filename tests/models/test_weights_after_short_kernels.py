"""weights_after_short_kernels: each (module, weight) pair names the weight of the very next
linear layer the forward pass runs after that module (what the L2 prefetch relies on),
checked against the order in which a real forward pass calls the modules."""

import pytest
import torch

from echo.layers.embedding import ParallelLMHead
from echo.layers.linear import LinearBase
from tests.models.test_logits_vs_transformers import echo_logits, make_runner, prefill_output


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_each_weight_is_the_next_linear_after_its_module(fixture, request):
    runner = make_runner(request.getfixturevalue(fixture))
    model = runner.model
    pairs = model.weights_after_short_kernels()
    watched = {id(m) for m, _ in pairs}
    calls = []  # (module, is_linear) in call order
    hooks = [m.register_forward_pre_hook(lambda mod, args: calls.append(mod))
             for m in model.modules()
             if id(m) in watched or isinstance(m, (LinearBase, ParallelLMHead))]
    try:
        echo_logits(runner, prefill_output([[1, 5, 9, 33, 7]]))
    finally:
        for h in hooks:
            h.remove()
    for module, weight in pairs:
        at = next(i for i, m in enumerate(calls) if m is module)
        following = next(m for m in calls[at + 1:] if isinstance(m, (LinearBase, ParallelLMHead)))
        assert following.weight is weight, (module, following)
    # every layer's two norms, attention and activation, and the final norm
    arch = model.arch
    assert len(pairs) == 4 * arch.num_layers + 1
    assert len({id(m) for m, _ in pairs}) == len(pairs)
    assert all(isinstance(w, torch.nn.Parameter) for _, w in pairs)
