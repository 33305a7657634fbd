"""Group accounting: when a rollout group is ready, when it is dropped, and its advantages (docs/design/scheduling.md#equations, docs/design/assessments.md, docs/design/training.md#objective).

The rule is the scheduler's (`gyre_sched.ledger.settle_group`), applied here to designated assessments. Selection is
by dispatch index, never by completion order: walking the group's executions in dispatch order and skipping
excluded ones, the first N form the group. The group is ready once all of those have valid rewards (``no_work``
placeholders count as valid zeros), and dropped once more executions were excluded than there are spares
(``excluded > dispatched - N``). Faster executions therefore never displace slower ones that are still running.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from gyre_eval.types import AdvantageMode, Assessment, GroupStatus, MemberReward
from gyre_sched.ledger import settle_group
from gyre_sched.types import AssessedStatus

GRPO_EPS = 1e-6


def group_advantages(rewards: Sequence[float], mode: AdvantageMode = "grpo") -> list[float]:
    """The one advantage formula of Gyre (gyre-train's buffer uses it too), aligned with ``rewards``.

    GRPO: ``(r - mean) / (std + 1e-6)`` with the **population** std over the group (ddof = 0); ``mean``: ``r - mean``.
    A group whose rewards are all equal gets all-zero advantages (its executions still count in the batch's N*B
    normalization)."""
    if not rewards:
        return []
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    mean = math.fsum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if mode == "mean":
        return centered
    if mode != "grpo":
        raise ValueError(f"unknown advantage mode {mode!r} (expected 'grpo' or 'mean')")
    std = math.sqrt(math.fsum(c * c for c in centered) / len(rewards))
    return [c / (std + GRPO_EPS) for c in centered]


def _settled(a: Assessment | None) -> AssessedStatus | None:
    if a is None or (a.status == "unresolved" and not a.excluded):
        return None
    return "excluded" if a.excluded else a.status


def group_status(
    group_id: str,
    size: int,
    dispatched: int,
    designated: Iterable[Assessment],
    mode: AdvantageMode = "grpo",
) -> GroupStatus:
    """Readiness of a group from its executions' designated assessments (at most one per execution)."""
    by_index: dict[int, Assessment] = {}
    for a in designated:
        if a.dispatch_index in by_index:
            raise ValueError(
                f"group {group_id}: two designated assessments at dispatch index {a.dispatch_index}"
            )
        by_index[a.dispatch_index] = a
    valid = sum(1 for a in by_index.values() if a.status in ("valid", "no_work"))
    excluded = sum(1 for a in by_index.values() if a.excluded)
    pending = dispatched - valid - excluded
    common = dict(group_id=group_id, size=size, dispatched=dispatched, valid=valid, excluded=excluded)
    statuses = [_settled(by_index.get(index)) for index in range(dispatched)]
    state, indices = settle_group(statuses, size)  # the scheduler's own rule (gyre_sched.ledger)
    if state == "dropped":
        reason = (
            f"{excluded} of {dispatched} executions excluded; at most {dispatched - size} may be (N={size})"
        )
        return GroupStatus(**common, pending=pending, state="dropped", advantage_mode=mode, reason=reason)
    # Pending: the earliest live execution has no reward yet, and a later one may not jump ahead of it.
    if state == "pending":
        return GroupStatus(**common, pending=pending, state="pending", advantage_mode=mode)
    chosen = [by_index[i] for i in indices]
    rewards = [float(a.score) for a in chosen]  # valid and no_work scores are never None
    advantages = group_advantages(rewards, mode)
    members = [
        MemberReward(
            execution_id=a.execution_id,
            dispatch_index=a.dispatch_index,
            status=a.status,
            reward=r,
            advantage=adv,
        )
        for a, r, adv in zip(chosen, rewards, advantages, strict=True)
    ]
    return GroupStatus(**common, pending=pending, state="ready", members=members, advantage_mode=mode)
