"""The capacity bound is a true lower bound: below every simulated schedule of the same executions on the same cluster
(every policy, the dispatch-order reference, the clairvoyant longest-first one), above the ideal bound, and it binds
(exceeds the ideal bound) exactly when the slots are short."""

from __future__ import annotations

import pytest

from gyre_sched.bound import (
    capacity_bound,
    dispatch_order_config,
    dispatch_order_reference,
    group_demands,
    rollout_slots,
)
from gyre_sched.sim import Simulator

# (slots per node, seed, phi, mu, k_spare, share of executions that hang)
CASES = [
    (5, 3, 0.5, 3, 0, 0.0),
    (5, 4, 0.0, 2, 1, 0.0),
    (5, 5, 1.0, 1, 1, 0.0),
    (12, 3, 0.5, 3, 1, 0.0),
    (5, 4, 0.5, 3, 0, 0.05),  # 36 groups dropped and refilled: refills take other plans under each policy
    (12, 5, 0.0, 2, 1, 0.05),
]


@pytest.mark.parametrize(("slots", "seed", "phi", "mu", "k", "hang"), CASES)
def test_capacity_bound_is_below_every_schedule_and_above_the_ideal_bound(
    small, slots, seed, phi, mu, k, hang
):
    over = {
        "seed": seed,
        "cluster": {"slots_per_node": slots},
        "policy": {"k_spare": k},
        "workload": {"overall_timeout_rate": hang},
    }
    cfg = small("elastic", phi, mu, bursts=4, **over)
    cb = capacity_bound(cfg)
    assert cb.slots == rollout_slots(cfg) == 4 * slots
    assert cb.ideal_s <= cb.end_time_s == max(cb.ideal_s, cb.capacity_s)
    assert cb.step_s == sorted(cb.step_s) and cb.step_s[-1] == cb.capacity_s
    kinds = [("elastic", phi), ("async", phi)] + ([("colocate", 0.0)] if phi == 0 else [])
    times = {kind: Simulator(small(kind, p, mu, bursts=4, **over)).run().end_time_s for kind, p in kinds}
    times["dispatch_order"] = dispatch_order_reference(cfg).end_time_s
    times["longest_first"] = dispatch_order_reference(cfg, longest_first=True).end_time_s
    for name, t in times.items():
        assert cb.end_time_s <= t, (name, cb, times)
    if slots == 5 and hang == 0:  # short of slots: the capacity constraints bind, by a margin
        assert cb.capacity_s > 1.1 * cb.ideal_s, cb


def test_with_ample_slots_only_the_ideal_bound_is_left(small):
    cfg = small("elastic", 0.5, 3, bursts=4, cluster={"C_s": 10**6})
    cb = capacity_bound(cfg)
    assert cb.end_time_s == cb.ideal_s
    # the chained tail constraints alone reproduce the simulated ideal bound when no group drops
    assert cb.capacity_s == pytest.approx(cb.ideal_s, rel=1e-9)
    ref = dispatch_order_config(cfg).policy_params()
    assert ref.K == 1 and ref.C_s == rollout_slots(cfg) and ref.kind == "async"


def test_group_demands_skip_dropped_groups_and_count_excluded_executions(small):
    cfg = small("elastic", 0.0, 2, bursts=2, policy={"k_spare": 1}, workload={"overall_timeout_rate": 0.2})
    seqs, work, ready = group_demands(cfg, 40)
    assert len(seqs) == 40 and list(seqs) == sorted(set(seqs.tolist()))
    sim = Simulator(cfg)
    for s, w, r in zip(seqs.tolist(), work, ready, strict=True):
        plans = [sim.workload.plan(s, i) for i in range(5)]
        kept = [i for i, p in enumerate(plans) if p.status != "excluded"][:4]
        assert len(kept) == 4 and w == pytest.approx(sum(p.duration_s for p in plans[: kept[-1] + 1]))
        assert r == pytest.approx(max(p.duration_s + p.assess_delay_s for p in plans[: kept[-1] + 1]))
    assert seqs[-1] > 39  # some groups can never become ready (more than k_spare of 5 excluded)


@pytest.mark.parametrize("policy", [{"planner": "adaptive"}, {"dispatch": "continuous", "q_c": 1}])
def test_capacity_bound_refuses_what_it_cannot_bound(small, policy):
    with pytest.raises(ValueError, match="boundary dispatch with the fixed planner"):
        capacity_bound(small("elastic", 0.5, 3, bursts=2, policy=policy))
