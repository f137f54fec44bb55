"""merge_splits (echo_kernels/attention/reduce.py): the softmax-weighted merge of split-KV
partials against the formula computed in PyTorch over the splits that saw a key."""

import torch

from echo_kernels.attention.common import M_FLOOR
from echo_kernels.attention.reduce import merge_splits


def merged_ref(part_acc: torch.Tensor, part_ml: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s over the splits `seen`, m their max;
    zero where a row has none."""
    m, l_sum = part_ml[..., 0], part_ml[..., 1]
    m = torch.where(seen, m, torch.tensor(float("-inf")))
    top = m.max(dim=-1, keepdim=True).values
    w = torch.where(seen, torch.exp2(m - top.clamp(min=-1e30)), torch.tensor(0.0))
    acc = torch.where(seen[..., None], part_acc, torch.tensor(0.0))
    denom = (w * l_sum).sum(-1, keepdim=True)
    # a row with no split seen: every weight 0, so 0 / 1
    return (w[..., None] * acc).sum(-2) / torch.where(denom == 0, 1.0, denom)


def test_splits_without_a_key_are_neither_weighed_nor_read(device):
    """Splits that saw no key hold m = M_FLOOR and l = 0 and may never have written their
    output (a launch captured for a longer context skips it): NaN there must not reach the
    result. Rows with every split seen, some, one, and none (a padded sequence: zeros)."""
    torch.manual_seed(0)
    tokens, heads, splits, head_dim = 4, 3, 6, 32
    part_acc = torch.randn(tokens, heads, splits, head_dim)
    part_ml = torch.stack([torch.randn(tokens, heads, splits) * 4,
                           torch.rand(tokens, heads, splits) + 0.5], dim=-1)
    seen = torch.ones(tokens, heads, splits, dtype=torch.bool)
    seen[1, :, 3:] = False  # the context's keys fill the first three splits
    seen[2, :, 1:] = False  # one split
    seen[3] = False  # no key at all
    part_ml[..., 0][~seen] = M_FLOOR.value
    part_ml[..., 1][~seen] = 0.0
    part_acc[~seen] = float("nan")  # never written
    out = torch.empty(tokens, heads, head_dim, device=device)
    merge_splits(part_acc.to(device), part_ml.to(device), out)
    torch.testing.assert_close(out.cpu(), merged_ref(part_acc, part_ml, seen), atol=1e-5,
                               rtol=1e-5)
    assert not out.isnan().any() and (out[3] == 0).all()
