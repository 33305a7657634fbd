"""Group accounting: readiness with N valid rewards, dispatch-order selection, drops, GRPO and mean-only advantages."""

import math

import pytest

from gyre_eval.groups import GRPO_EPS, group_advantages, group_status
from gyre_eval.types import Assessment, Provenance

PROV = Provenance(evaluator="task", kind="exec")


def _a(index: int, status: str, score: float | None = None, final: bool = True) -> Assessment:
    if status == "no_work":
        score = 0.0
    return Assessment(
        id=f"a{index}",
        execution_id=f"e{index}",
        group_id="g",
        dispatch_index=index,
        artifact_ref="/ws",
        artifact_version="final",
        branch="main",
        evaluator="task",
        designated=True,
        status=status,
        score=score,
        final=final,
        attempts=1,
        provenance=PROV,
        submitted_at=0.0,
        deadline=1.0,
    )


def test_grpo_uses_population_std_and_mean_only_is_centered():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5]
    mean = 0.5
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))  # population, not sample
    assert group_advantages(rewards, "grpo") == pytest.approx(
        [(r - mean) / (std + GRPO_EPS) for r in rewards]
    )
    assert group_advantages(rewards, "mean") == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0])
    assert group_advantages([0.3, 0.3], "grpo") == [
        0.0,
        0.0,
    ]  # equal rewards: zero advantage, no division by 0
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages([1.0], "ppo")


def test_group_is_ready_with_n_valid_rewards_and_no_work_counts_as_a_valid_zero():
    status = group_status("g", 3, 3, [_a(0, "valid", 1.0), _a(1, "no_work"), _a(2, "valid", 0.5)])
    assert (status.state, status.valid, status.excluded, status.pending) == ("ready", 3, 0, 0)
    assert [m.reward for m in status.members] == [1.0, 0.0, 0.5]
    assert [m.status for m in status.members] == ["valid", "no_work", "valid"]
    assert [m.advantage for m in status.members] == pytest.approx(group_advantages([1.0, 0.0, 0.5]))


def test_group_waits_for_missing_and_unfinished_rewards():
    assert group_status("g", 2, 2, [_a(0, "valid", 1.0)]).state == "pending"
    still_trying = _a(1, "unresolved", final=False)
    status = group_status("g", 2, 2, [_a(0, "valid", 1.0), still_trying])
    assert (status.state, status.pending, status.members) == ("pending", 1, [])


def test_spares_replace_excluded_executions_in_dispatch_order_never_by_completion():
    # N=2 with one spare. Index 2 finished first, but index 1 is still running: not ready yet.
    early_spare = [_a(0, "valid", 1.0), _a(2, "valid", 0.0)]
    assert group_status("g", 2, 3, early_spare).state == "pending"
    # Index 1 finished: the group is 0 and 1; the spare at index 2 is surplus.
    status = group_status("g", 2, 3, [*early_spare, _a(1, "valid", 0.5)])
    assert status.state == "ready" and [m.dispatch_index for m in status.members] == [0, 1]
    # Index 1 was excluded instead: the spare at index 2 takes its place.
    status = group_status("g", 2, 3, [*early_spare, _a(1, "unresolved")])
    assert status.state == "ready" and [m.dispatch_index for m in status.members] == [0, 2]
    assert status.excluded == 1


def test_group_is_dropped_when_it_can_no_longer_reach_n():
    one_excluded = [_a(0, "unresolved"), _a(1, "valid", 1.0)]
    assert group_status("g", 2, 2, one_excluded).state == "dropped"
    assert group_status("g", 2, 3, one_excluded).state == "pending"  # a spare may still make it
    dropped = group_status("g", 2, 3, [*one_excluded, _a(2, "unresolved")])
    assert dropped.state == "dropped" and dropped.excluded == 2 and dropped.members == []
    assert "2 of 3 executions excluded; at most 1 may be" in dropped.reason


def test_unresolved_is_never_averaged_in_as_zero():
    # An excluded execution must not drag the mean: advantages use the N valid rewards only.
    status = group_status("g", 2, 3, [_a(0, "valid", 1.0), _a(1, "unresolved"), _a(2, "valid", 1.0)])
    assert status.state == "ready" and [m.advantage for m in status.members] == [0.0, 0.0]


def test_two_designated_assessments_at_one_index_are_refused():
    with pytest.raises(ValueError, match="two designated"):
        group_status("g", 1, 1, [_a(0, "valid", 1.0), _a(0, "valid", 0.0)])
