"""Context parallelism over THD-packed rows: the zigzag partition and the reassembly of per-token values (pure
index arithmetic; the attention itself needs Transformer Engine on a GPU, see test_megatron_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from gyre_train.megatron.thd import cp_assemble, cp_partition


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_partition_covers_every_token_once_with_equal_zigzag_shares(cp: int) -> None:
    cu = [0, 5, 12, 13, 40]
    parts = [cp_partition(cu, cp, r) for r in range(cp)]
    cu_padded = parts[0][1]
    assert all(p[1] == cu_padded for p in parts)  # every rank sees the same padded boundaries
    for r in range(len(cu) - 1):
        n, padded = cu[r + 1] - cu[r], cu_padded[r + 1] - cu_padded[r]
        assert padded % (2 * cp) == 0 and n <= padded < n + 2 * cp
    sizes = {len(idx) for idx, _ in parts}
    assert sizes == {cu_padded[-1] // cp}  # equal shares
    real = sorted(i for idx, _ in parts for i in idx if i >= 0)
    assert real == list(range(cu[-1]))  # every token exactly once
    # Zigzag: in row 3 (27 tokens, padded to a multiple of 2cp) rank r holds chunk r and chunk 2cp-1-r.
    half = (cu_padded[4] - cu_padded[3]) // (2 * cp)
    for r, (idx, _) in enumerate(parts):
        start = cu_padded[3] // cp
        first, second = idx[start : start + half], idx[start + half : start + 2 * half]
        assert first == [cu[3] + j for j in range(r * half, (r + 1) * half)]
        hi = [cu[3] + j if j < 27 else -1 for j in range((2 * cp - 1 - r) * half, (2 * cp - r) * half)]
        assert second == hi


def test_one_rank_is_the_identity_and_bad_ranks_are_refused() -> None:
    assert cp_partition([0, 3, 7], 1, 0) == ([0, 1, 2, 3, 4, 5, 6], [0, 3, 7])
    with pytest.raises(ValueError):
        cp_partition([0, 3], 2, 2)


def test_assemble_puts_every_value_back_and_keeps_the_gradient_local() -> None:
    cu, cp = [0, 5, 12], 2
    parts = [torch.tensor(cp_partition(cu, cp, r)[0]) for r in range(cp)]
    truth = torch.arange(12, dtype=torch.float32) * 0.5 - 2.0
    values = [
        torch.where(p >= 0, truth[p.clamp(min=0)], torch.full_like(truth[:1].expand(len(p)), 99.0))
        for p in parts
    ]
    own = values[1].clone().requires_grad_(True)
    full = cp_assemble(own, [v.detach() for v in values], parts, 1, 12)
    assert torch.equal(full.detach(), truth)  # padding (99) dropped, every position filled
    (full * torch.arange(12.0)).sum().backward()
    # d/d own[k] = the weight of own's position; zero for padding; the other rank's values carry no gradient.
    expected = torch.where(parts[1] >= 0, parts[1].clamp(min=0).float(), torch.zeros(len(parts[1])))
    assert torch.equal(own.grad, expected)
