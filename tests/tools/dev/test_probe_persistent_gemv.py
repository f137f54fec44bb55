"""probe_persistent_gemv's "shares" kernel against a float64 PyTorch chain, on the interpreter.

The interpreter runs one program after another, so a grid barrier would wait forever there:
the chain runs barrier-free in one program (which is then in order), and a grid of programs is
checked on the first GEMV alone (the only one whose input no program of the grid writes)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[3] / d) for d in ("tools", "tools/dev")]

from probe_persistent_gemv import ShareChain, layer_views  # noqa: E402

# (N, K) a GEMV; each reads the first K outputs of the one before, down's K (48) not a power of
# two as Qwen3-0.6B's 3072 is not
SHAPES = ((64, 32), (32, 64), (128, 32), (32, 48))


def chain_reference(x, views):
    y = x.double()
    for layer in views:
        for w in layer:
            y = w.double() @ y[:w.shape[1]]
    return y


@pytest.mark.parametrize("load_before_arrival", [True, False])
def test_one_program_walks_the_chain(load_before_arrival):
    torch.manual_seed(0)
    per_layer = sum(n * k for n, k in SHAPES)
    weights = torch.randn(3 * per_layer) / 8
    x = torch.randn(SHAPES[0][1])
    views = layer_views(weights, 3, SHAPES)
    run = ShareChain(weights, x, 3, load_before_arrival, barriers=False, shapes=SHAPES,
                     rows=tuple(n for n, _ in SHAPES))
    assert run.programs == 1
    want = chain_reference(x, views)
    torch.testing.assert_close(run().double(), want, atol=1e-5 * want.abs().max().item(),
                               rtol=0)


def test_each_program_computes_its_rows_of_the_first_gemv():
    torch.manual_seed(1)
    per_layer = sum(n * k for n, k in SHAPES)
    weights = torch.randn(per_layer) / 8
    x = torch.randn(SHAPES[0][1])
    views = layer_views(weights, 1, SHAPES)
    # 4 programs in qkv and gate_up, 8 in o_proj and down (4 rows each): 8 programs
    run = ShareChain(weights, x, 1, True, barriers=False, shapes=SHAPES, rows=(16, 4, 32, 4))
    assert run.programs == 8
    run()
    want = views[0][0].double() @ x.double()
    torch.testing.assert_close(run.bufs[1, :SHAPES[0][0]].double(), want,
                               atol=1e-5 * want.abs().max().item(), rtol=0)
