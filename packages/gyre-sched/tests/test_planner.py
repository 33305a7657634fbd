"""The adaptive planner holds a realized staleness target (recomputed from the trace), chooses each burst's dispatch
and spares, and traces its choices; the ideal bound is below every policy on the same executions."""

from __future__ import annotations

import io

import orjson
import pytest

from gyre_sched.bound import ideal_bound, ideal_config
from gyre_sched.config import PolicyParams, SimConfig
from gyre_sched.planner import accrued_staleness
from gyre_sched.presets import NL2REPO, deep_merge
from gyre_sched.sim import Simulator
from gyre_sched.trace import summarize_trace


def traced(cfg: SimConfig):
    buf = io.BytesIO()
    sim = Simulator(cfg, trace_stream=buf)
    res = sim.run()
    return res, [orjson.loads(x) for x in buf.getvalue().splitlines()], sim


@pytest.mark.parametrize("target", [0.6, 1.3, 2.2])
def test_the_planner_meets_its_staleness_target(small, target):
    cfg = small("elastic", 0.5, 2, bursts=16, policy={"planner": "adaptive", "target_staleness": target})
    res, lines, sim = traced(cfg)
    # realized, per consumed group, warm-up burst and refills aside (as eq. 2 is checked): within 0.05 of the target
    assert abs(res.mean_staleness_steady - target) <= 0.05, res.mean_staleness_steady
    # every group: the run's end leaves the oldest groups unconsumed
    assert res.mean_staleness <= target + 0.05
    s = summarize_trace(lines)  # the trace recomputes exactly what the policy reports
    assert s.staleness == res.staleness
    plans = [x for x in lines if x["ev"] == "burst_plan"]
    dispatched = [x for x in lines if x["ev"] == "dispatch" and not x["refill"]]
    assert plans[0]["version"] == 0 and sum(x["dispatch"] for x in plans) == len(dispatched)
    # the planner's bookkeeping identity: sum of d over consumed groups + age of the outstanding ones
    assert accrued_staleness(sim.policy) == sum(res.staleness) + sum(
        sim.policy.version - g.v_d
        for g in sim.policy.ledger.groups.values()
        if g.state.value in ("open", "ready")
    )


def test_a_fixed_plan_traces_nothing_new(small):
    _, lines, _ = traced(small("elastic", 0.5, 3, bursts=2))
    assert not [x for x in lines if x["ev"] == "burst_plan"]


def test_spares_are_dropped_when_exclusions_take_whole_queries(small):
    """Broken queries hang in every execution: a spare rescues nothing and costs 1/N of a group."""
    pol = {"planner": "adaptive", "target_staleness": 1.0, "k_spare": 1}
    broken = {"overall_timeout_rate": 0.05, "exclusion": "per_query", "hang_query_rate": 0.05}
    scattered = {"overall_timeout_rate": 0.15, "exclusion": "per_execution"}
    for workload, expect in ((broken, 0), (scattered, 1)):
        res, lines, _ = traced(small("elastic", 0.5, 2, bursts=10, policy=pol, workload=workload))
        ks = [x["k_spare"] for x in lines if x["ev"] == "burst_plan"]
        assert ks[0] == 1 and ks[-1] == expect, ks
        assert res.counters["dropped_groups"] > 0


def test_adaptive_planner_refuses_continuous_dispatch():
    with pytest.raises(ValueError, match="adaptive planner"):
        PolicyParams(kind="elastic", K=2, C_e=4, planner="adaptive", dispatch="continuous")


def test_the_ideal_bound_is_below_every_policy(small):
    base = small("elastic", 0.5, 3, bursts=4)
    bound = ideal_bound(base)
    ideal = ideal_config(base)
    assert ideal.policy_params().C_s >= 10**9 and ideal.costs().cell_train_s_per_group < 1e-6
    for kind, phi, mu in (("elastic", 0.5, 3), ("async", 0.5, 3), ("colocate", 0.0, 3)):
        res = Simulator(small(kind, phi, mu, bursts=4)).run()
        assert bound.end_time_s < res.end_time_s, kind
    assert bound.staleness == Simulator(base).run().staleness or bound.mean_staleness == pytest.approx(
        1.5, abs=0.15
    )


@pytest.mark.slow
def test_on_the_preset_the_planner_holds_1_5_and_keeps_pace_with_the_best_fixed_setting():
    fixed = SimConfig.model_validate(deep_merge(NL2REPO, {"policy": {"k_spare": 0}}))
    adaptive = SimConfig.model_validate(
        deep_merge(NL2REPO, {"policy": {"planner": "adaptive", "target_staleness": 1.5}})
    )
    f, a = Simulator(fixed).run(), Simulator(adaptive).run()
    assert abs(a.mean_staleness_steady - 1.5) <= 0.05
    # measured: 68.96 h adaptive (it drops the preset's spare: exclusions come in whole queries) vs 68.81 h fixed
    assert a.end_time_s <= 1.02 * f.end_time_s
