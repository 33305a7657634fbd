"""Context parallelism over THD-packed rows (pure index arithmetic, no megatron import).

With CP ranks, each packed row of length n is padded at its end to a multiple of 2 x CP and cut into 2 x CP equal
chunks; CP rank c takes chunks c and 2 x CP - 1 - c (the load-balanced "zigzag" layout Transformer Engine's THD
context-parallel attention expects: causal attention costs the same on every rank). A rank's tokens are laid out
row after row, each row's two chunks back to back, so its share of row r starts at ``cu_padded[r] / CP``; the
attention and RoPE see the padded boundaries ``cu_padded`` (padding sits after a row's last token, so causal
attention never lets a real token see it).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = ["cp_assemble", "cp_partition"]


def cp_partition(cu_seqlens: Sequence[int], cp: int, rank: int) -> tuple[list[int], list[int]]:
    """This CP rank's tokens of a packed shard: ``(index, cu_padded)`` where ``index[k]`` is the packed position
    (in the unpadded shard) of the rank's k-th token, or -1 for padding, and ``cu_padded`` the padded row
    boundaries (the same on every rank). CP = 1 returns the shard unchanged."""
    cu = [int(x) for x in cu_seqlens]
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank {rank} of {cp} context-parallel ranks")
    if cp == 1:
        return list(range(cu[-1])), cu
    index: list[int] = []
    cu_padded = [0]
    unit = 2 * cp
    for start, end in itertools.pairwise(cu):
        n = end - start
        padded = -(-n // unit) * unit
        half = padded // unit
        cu_padded.append(cu_padded[-1] + padded)
        for lo in (rank * half, padded - (rank + 1) * half):
            index += [start + j if j < n else -1 for j in range(lo, lo + half)]
    return index, cu_padded


def cp_assemble(
    own: torch.Tensor,
    gathered: Sequence[torch.Tensor],
    parts: Sequence[torch.Tensor],
    rank: int,
    num_tokens: int,
) -> torch.Tensor:
    """Per-token values of the whole shard [num_tokens] from every CP rank's values (``gathered[c]`` in rank c's
    order, ``parts[c]`` its ``cp_partition`` index): rank ``rank``'s own entries come from ``own`` (with its
    autograd graph), the others are detached copies; padding is dropped."""
    full = torch.zeros(num_tokens, dtype=own.dtype, device=own.device)
    with torch.no_grad():
        for c, (idx, vals) in enumerate(zip(parts, gathered, strict=True)):
            if c != rank:
                keep = idx >= 0
                full[idx[keep].to(full.device)] = vals[keep.to(vals.device)].to(full.dtype)
    idx = parts[rank].to(own.device)
    keep = idx >= 0
    return full.index_put((idx[keep],), own[keep])
