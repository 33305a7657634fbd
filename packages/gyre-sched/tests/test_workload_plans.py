"""A workload definition played in a real run: time scaling, the evaluator attempts each plan carries, the execution ids
the workload harness reads, and the simulator predicting a recording from the definition it played."""

import math

import numpy as np
import pytest

from gyre_sched.config import WorkloadConfig
from gyre_sched.presets import NL2REPO, NL2REPO_SCALED, NL2REPO_SCALED_FACTOR
from gyre_sched.workload import StatisticalWorkload, terminations
from gyre_sched.workload_harness import execution_of, plan_of

BUSY = WorkloadConfig(
    query_median_s=10.0,
    query_sigma=0.4,
    exec_sigma=0.5,
    hard_query_rate=0.3,
    hard_query_factor=4.0,
    harness_timeout_s=30.0,
    overall_budget_s=40.0,
    failed_rate=0.1,
    failed_at_s=1.0,
    overall_timeout_rate=0.05,
    exclusion_known="stall",
    stall_detect_s=3.0,
    eval_latency_s=2.0,
    eval_failure_rate=0.4,
)
"""Every tail often, so that a few groups show each."""


def test_a_scaled_workload_is_the_same_workload_on_a_faster_clock():
    rng = np.random.default_rng(3)
    shape = (50, 17)
    draws = {
        "z_query": rng.standard_normal((50, 1)),
        "u_hard": rng.random((50, 1)),
        "u_prone": rng.random((50, 1)),
        "z_exec": rng.standard_normal(shape),
        "u_exec": rng.random((*shape, 3)),
    }
    base = WorkloadConfig.model_validate(NL2REPO["workload"])
    end, code, stall = terminations(base, **draws)
    f = NL2REPO_SCALED_FACTOR
    end_s, code_s, stall_s = terminations(base.scaled(f), **draws)
    assert np.array_equal(code, code_s)  # the same executions time out, fail and hang
    assert np.allclose(end * f, end_s) and np.allclose(stall * f, stall_s)
    assert (code == 2).any()  # harness timeouts are among them
    scaled = WorkloadConfig.model_validate(NL2REPO_SCALED)
    assert scaled.harness_timeout_s == pytest.approx(14400 * f) and scaled.overall_budget_s == pytest.approx(
        18000 * f
    )
    assert scaled.overall_timeout_rate == 0.0 and scaled.tool_latency_s == 0.5
    with pytest.raises(ValueError, match="> 0"):
        base.scaled(0.0)


def test_each_plan_carries_the_evaluator_attempts_that_give_its_assessment():
    w = StatisticalWorkload(BUSY, seed=11)
    seen = set()
    for group in range(40):
        for index in range(6):
            plan = w.plan(group, index)
            seen.add((plan.outcome, plan.status))
            if plan.outcome in ("stalled", "overall_timeout"):
                assert plan.evaluation == () and plan.status == "excluded"
                assert (
                    plan.stall_at_s is not None
                    and plan.stall_at_s + BUSY.stall_detect_s >= plan.duration_s - 1e-9
                )
                continue
            if plan.outcome == "failed":  # a placeholder: gyre-eval asks no evaluator
                assert plan.evaluation == () and plan.status in ("no_work", "excluded")
                continue
            latencies = [lat for lat, _ in plan.evaluation]
            oks = [ok for _, ok in plan.evaluation]
            assert not any(oks[:-1])  # attempts stop at the first success
            if plan.status == "valid":
                assert oks[-1] and math.isclose(sum(latencies), plan.assess_delay_s, abs_tol=1e-9)
                assert plan.duration_s + sum(latencies) <= BUSY.overall_budget_s
            else:  # the budget ran out during the last attempt
                assert plan.status == "excluded"
                assert plan.duration_s + sum(latencies) > BUSY.overall_budget_s
                assert plan.duration_s + sum(latencies[:-1]) <= BUSY.overall_budget_s
    assert {
        ("harness_timeout", "valid"),
        ("completed", "valid"),
        ("harness_timeout", "excluded"),
        ("stalled", "excluded"),
        ("failed", "no_work"),
    } <= seen


def test_the_harness_plays_the_plan_the_simulator_gives_the_same_execution():
    w = StatisticalWorkload(BUSY, seed=5)
    for group, index in [(0, 0), (3, 2), (17, 4)]:
        assert plan_of(BUSY, 5, f"g{group}.e{index}") == w.plan(group, index)
    assert execution_of("g12.e3") == (12, 3)
    for bad in ("g12", "12.e3", "gx.e1", "g1.e", "g1.ex", "workspace"):
        with pytest.raises(ValueError, match="not an execution id"):
            execution_of(bad)
