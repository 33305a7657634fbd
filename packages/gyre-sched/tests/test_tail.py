"""Tail-aware mechanisms: idle spares (launched only on capacity nothing else wants, promoted the moment an exclusion
makes one count) and hangs known at a stall instead of at the overall budget. Group membership stays the first N
non-excluded executions in dispatch-index order; every execution still terminates once."""

from __future__ import annotations

import io

import orjson

from gyre_sched.config import PolicyParams
from gyre_sched.events import Assessed, Launch, Withdraw
from gyre_sched.policies import make_policy
from gyre_sched.sim import Simulator


def launched(d) -> list[str]:
    return [x.spec.execution_id for x in d.of(Launch)]


def test_idle_spares_wait_behind_regular_entries_and_jump_ahead_when_needed(driver):
    params = PolicyParams(kind="elastic", K=1, C_e=2, N=2, B=1, phi=1.0, mu=1, k_spare=1, spares="idle")
    d = driver(make_policy(params, deep_checks=True))
    assert launched(d) == ["g0.e0", "g0.e1"]
    d.finish("g0.e0", status=None)  # terminated, evaluation pending
    assert launched(d)[-1] == "g1.e0"  # a regular entry before g0's spare
    d.finish("g0.e1")
    assert launched(d)[-1] == "g1.e1"
    d.send(Assessed("g0.e0", "excluded"))  # g0's spare now counts: it goes to the front
    d.finish("g1.e0")
    assert launched(d)[-1] == "g0.e2"
    # the freed slot has nothing else to run: g1's spare uses it, then g1 is ready without it
    d.finish("g1.e1")
    assert launched(d)[-1] == "g1.e2" and d.cancelled == ["g1.e2"]
    d.settle_cancels()
    d.finish("g0.e2")  # g0 ready with e1 and the spare (dispatch-index order, e0 excluded)
    assert d.policy.ledger.members("g0") == ["g0.e1", "g0.e2"]
    led = d.policy.ledger
    assert (led.d, led.p, led.f, led.x) == (6, 6, 6, 0)


def test_an_idle_spare_nobody_needed_is_withdrawn(driver):
    params = PolicyParams(kind="elastic", K=1, C_e=2, N=2, B=1, phi=1.0, mu=1, k_spare=1, spares="idle")
    d = driver(make_policy(params, deep_checks=True))
    d.finish("g0.e0")
    d.finish("g0.e1")  # g0 ready; its spare was queued behind g1's regular entries
    assert [w.execution_id for w in d.of(Withdraw)] == ["g0.e2"] and "g0.e2" not in launched(d)
    assert d.policy.ledger.x == 1


def test_eager_spares_launch_with_their_group(driver):
    params = PolicyParams(kind="elastic", K=1, C_e=3, N=2, B=1, phi=1.0, mu=1, k_spare=1)
    d = driver(make_policy(params, deep_checks=True))
    assert launched(d) == ["g0.e0", "g0.e1", "g0.e2"]


def run(cfg):
    buf = io.BytesIO()
    res = Simulator(cfg, trace_stream=buf, deep_checks=True).run()
    return res, [orjson.loads(x) for x in buf.getvalue().splitlines()]


def test_idle_spares_in_a_saturated_simulation(small):
    wl = {"overall_timeout_rate": 0.06}
    eager, _ = run(small("elastic", 0.5, 3, bursts=4, policy={"k_spare": 1}, workload=wl))
    idle, lines = run(
        small("elastic", 0.5, 3, bursts=4, policy={"k_spare": 1, "spares": "idle"}, workload=wl)
    )
    assert idle.counters["withdrawn_surplus"] > eager.counters["withdrawn_surplus"]  # spares that never ran
    assert idle.counters["p"] < eager.counters["p"]
    assert idle.staleness == eager.staleness or abs(idle.mean_staleness - eager.mean_staleness) < 0.1
    ends = [x["execution"] for x in lines if x["ev"] == "terminate"]
    assert len(ends) == len(set(ends))  # each execution terminates once


def test_hangs_known_at_a_stall_end_early_excluded(small):
    wl = {"overall_timeout_rate": 0.06, "exclusion_known": "stall", "stall_detect_s": 600.0}
    res, lines = run(small("elastic", 0.5, 3, bursts=4, policy={"k_spare": 1}, workload=wl))
    budget, _ = run(
        small("elastic", 0.5, 3, bursts=4, policy={"k_spare": 1}, workload={"overall_timeout_rate": 0.06})
    )
    launched_at = {x["execution"]: x["t"] for x in lines if x["ev"] == "launch"}
    stalled = [x for x in lines if x["ev"] == "terminate" and x["outcome"] == "stalled"]
    assert stalled and not [x for x in lines if x["ev"] == "terminate" and x["outcome"] == "overall_timeout"]
    assert all(x["t"] - launched_at[x["execution"]] < 7200.0 for x in stalled)  # before the overall budget
    assessed = {x["execution"] for x in lines if x["ev"] == "assessed"}
    assert not assessed & {x["execution"] for x in stalled}  # excluded without an assessment
    assert res.end_time_s < budget.end_time_s
