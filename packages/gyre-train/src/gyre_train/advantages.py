"""Group-relative advantages from the N rewards of a rollout group (docs/design/assessments.md).

GRPO (default): ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the **population** std over the group (ddof = 0).
Mean-only: ``A_i = r_i - mean(r)``. A group whose rewards are all equal gets all-zero advantages (its executions still
count in the batch's N*B normalization).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageMode = Literal["grpo", "mean"]


def group_advantages(
    rewards: Sequence[float], mode: AdvantageMode = "grpo", eps: float = 1e-6
) -> list[float]:
    """Advantages of one group, aligned with ``rewards``."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    n = len(rewards)
    mean = math.fsum(rewards) / n
    centred = [r - mean for r in rewards]
    if mode == "mean":
        return centred
    if mode != "grpo":
        raise ValueError(f"advantage mode must be 'grpo' or 'mean', got {mode!r}")
    std = math.sqrt(math.fsum(c * c for c in centred) / n)
    return [c / (std + eps) for c in centred]
