"""Each equation and rule of docs/design/scheduling.md#equations at its boundary, driving the policy core by hand."""

from __future__ import annotations

import pytest

from gyre_sched.config import PolicyParams
from gyre_sched.errors import InvariantError
from gyre_sched.events import (
    BeginTransition,
    Cancel,
    Dispatch,
    GroupAssigned,
    GroupDropped,
    GroupReady,
    Launch,
    MicrostepClaimed,
    OpenBatch,
    Publish,
    PublishDone,
    Reroute,
    StepDone,
    Tick,
    TransitionDone,
    Withdraw,
)
from gyre_sched.ledger import Ledger
from gyre_sched.policies import make_policy
from gyre_sched.types import CellRole


def P(**kw) -> PolicyParams:
    base = {
        "kind": "elastic",
        "K": 3,
        "C_e": 2,
        "N": 2,
        "B": 2,
        "phi": 0.0,
        "mu": 1,
        "rho_min": 0.5,
        "tau_s": 0.0,
    }
    return PolicyParams(**{**base, **kw})


def test_initial_dispatch_eq1(driver):
    d = driver(make_policy(P(phi=0.5, mu=2, k_spare=1, C_e=100)))
    led = d.policy.ledger
    assert led.d == (0.5 + 2) * 3 * 2 == 15  # (phi + mu) * N_d * B
    assert [x.v_d for x in d.of(Dispatch)] == [0] * 5
    assert len(d.of(Launch)) == 15


def test_phi_B_must_be_whole():
    with pytest.raises(ValueError, match="phi \\* B"):
        P(phi=0.25, B=2)


def test_capacity_eq3_and_launch_eq4(driver):
    d = driver(make_policy(P(K=3, C_e=2, C_s=1, N=2, B=4, phi=0.5)))  # 12 executions, capacity 7
    pol, led = d.policy, d.policy.ledger
    assert pol.capacity() == 3 * 2 + 1
    assert len(d.of(Launch)) == 7 and led.queued == 5  # exactly C(t), the excess stays queued
    d.finish(d.running[0])
    assert len(d.of(Launch)) == 8 and led.running == 7


def test_launch_order_standalone_then_descending_cells(driver):
    d = driver(make_policy(P(K=3, C_e=2, C_s=1, N=1, B=7, rho_min=1.0)))
    engines = [x.spec.engine for x in d.of(Launch)]
    assert engines == ["standalone", "cell:2", "cell:2", "cell:1", "cell:1", "cell:0", "cell:0"]


def test_no_launch_while_publishing(driver):
    # K=1 core + standalone pool of 2; N=1, B=1, mu=1, phi=2: three groups, two run at a time
    d = driver(make_policy(P(K=1, C_e=1, C_s=2, N=1, B=1, phi=2.0, rho_min=1.0)))
    d.finish("g0.e0")  # ready; eq.5 for the core: w=2 <= C_s -> join
    assert d.of(BeginTransition)[-1].cell == 0
    d.finish_transitions()
    assert d.of(OpenBatch)
    d.send(GroupAssigned("g0"))
    d.send(MicrostepClaimed(0, "g0"))
    d.send(StepDone(1))
    assert d.publishing == 1
    launches = len(d.of(Launch))
    d.finish("g1.e0")  # a slot frees during publication: engines are not ready, nothing launches
    assert len(d.of(Launch)) == launches and d.policy.ledger.queued == 0
    d.send(PublishDone(1))
    assert len(d.of(Launch)) == launches + 1  # the post-publication dispatch launches at v_d = 1
    assert d.of(Launch)[-1].spec.dispatch_version == 1


def _eq5_setup(driver, tau: float = 0.0):
    # K=3, C_e=2, N=2, B=4, phi=0.5: 6 groups = 12 executions, capacity 6; core joins when w <= 2*2 = 4
    d = driver(make_policy(P(K=3, C_e=2, N=2, B=4, phi=0.5, tau_s=tau)))
    for eid in ["g0.e0", "g0.e1", "g1.e0", "g1.e1", "g2.e0", "g2.e1", "g3.e0"]:
        d.finish(eid, status="valid")
    return d


def test_join_eq5_boundary(driver):
    d = _eq5_setup(driver)
    assert d.policy.ledger.waterlevel == 5 and len(d.policy.ledger.ready) == 3
    d.send(Tick(), dt=1000.0)
    assert not d.of(BeginTransition)  # w = 5 > (K - 0 - 1) * C_e = 4
    d.finish("g3.e1")
    assert d.policy.ledger.waterlevel == 4
    assert [(x.cell, x.to_role) for x in d.of(BeginTransition)] == [(0, CellRole.TO_TRAINING)]


def test_supply_timer_tau(driver):
    d = _eq5_setup(driver, tau=50.0)
    d.send(Tick(), dt=100.0)  # supply held since t=0 already: the timer alone is not enough, eq.5 fails
    d.finish("g3.e1")  # eq.5 now holds and supply held >= tau: join
    assert d.of(BeginTransition)
    d.finish_transitions()  # timer resets after a transition (and at batch start)
    since = d.policy.supply_since
    assert since == d.now and d.policy.next_wakeup() == since + 50.0
    d.finish("g4.e0")
    d.finish("g4.e1")  # w = 2 <= (K - 1 - 1) * C_e: only the timer holds satellite 1 back
    d.send(Tick(), dt=49.999)
    assert len(d.of(BeginTransition)) == 1  # satellite 1 must wait a full tau
    d.send(Tick(), dt=0.001)
    assert [x.cell for x in d.of(BeginTransition)] == [0, 1]


def test_supply_rho_min_boundary(driver):
    # B=4, rho_min=0.5: 2 ready unassigned groups needed; eq.5 holds from the start (huge C_e)
    d = driver(make_policy(P(K=3, C_e=100, N=1, B=4, rho_min=0.5)))
    d.finish("g0.e0")
    assert not d.of(BeginTransition)  # 1 < 0.5 * 4
    d.finish("g1.e0")
    assert d.of(BeginTransition)


def _eq6(driver, finish_g2: bool):
    # K=1 core + standalone pool C_s=2; N=1, B=1, mu=1, phi=3: four groups, w(0) = 4
    d = driver(make_policy(P(K=1, C_e=1, C_s=2, N=1, B=1, phi=3.0, rho_min=1.0)))
    d.finish("g0.e0")
    assert not d.of(BeginTransition)  # eq.5: w = 3 > C_s
    d.finish("g1.e0")  # w = 2: the core joins
    d.finish_transitions()
    d.send(GroupAssigned("g0"))
    d.send(MicrostepClaimed(0, "g0"))
    d.send(StepDone(1))
    if finish_g2:
        d.finish("g2.e0")
    d.send(PublishDone(1))
    return d


def test_core_persistence_eq6_boundary(driver):
    # eq.6: stay iff ready >= rho_min*B (g1 is) and w + mu*N_d*B <= (K-1)*C_e + C_s = 2
    stay = _eq6(driver, finish_g2=True)  # 1 + 1 == 2
    assert stay.policy.roles[0] is CellRole.TRAINING and stay.of(OpenBatch)[-1].version == 1
    leave = _eq6(driver, finish_g2=False)  # 2 + 1 > 2
    assert leave.policy.roles[0] is CellRole.TO_ROLLOUT
    assert [x.v_d for x in leave.of(Dispatch)][-1] == 1


def test_burst_end_sequence(driver):
    d = driver(make_policy(P(K=3, C_e=2, N=1, B=2, rho_min=0.5)))
    d.finish("g0.e0")  # core joins (w=1 <= 4)
    d.finish_transitions()  # satellite 1 joins (w=1 <= 2) and finishes
    assert d.policy.roles == [CellRole.TRAINING, CellRole.TRAINING, CellRole.ROLLOUT]
    d.send(GroupAssigned("g0"))
    d.send(MicrostepClaimed(1, "g0"))
    d.finish("g1.e0")  # w = 0: satellite 2 may join too (eq.5 with zero capacity left, nothing unsettled)
    assert d.policy.roles[2] is CellRole.TO_TRAINING
    d.send(GroupAssigned("g1"))
    out = d.send(StepDone(1))
    assert [(x.cell, x.to_role) for x in out if isinstance(x, BeginTransition)] == [(1, CellRole.TO_ROLLOUT)]
    assert not any(isinstance(x, Publish) for x in out)  # publication waits for every satellite
    out = d.send(TransitionDone(2))  # still switching at burst end: straight back to rollout
    assert [(x.cell, x.to_role) for x in out if isinstance(x, BeginTransition)] == [(2, CellRole.TO_ROLLOUT)]
    assert not any(isinstance(x, Publish) for x in d.send(TransitionDone(1)))
    out = d.send(TransitionDone(2))
    assert any(isinstance(x, Publish) and x.version == 1 for x in out)
    out = d.send(PublishDone(1))
    disp = [x for x in out if isinstance(x, Dispatch)]
    assert len(disp) == 2 and {x.v_d for x in disp} == {1}  # mu * B groups at the new version
    assert d.policy.roles[0] is CellRole.TO_ROLLOUT  # no ready group: eq.6's supply check fails
    assert d.policy.staleness == [0, 0]


def test_reroute_destination_order(driver):
    d = driver(make_policy(P(K=3, C_e=2, C_s=1, N=1, B=7, rho_min=0.25)))
    d.finish("g0.e0")  # frees the standalone slot
    d.finish("g1.e0")  # frees a slot on cell 2; w = 5 <= 2*2 + 1, 2 ready >= 0.25*7
    moves = [(x.execution_id, x.engine) for x in d.of(Reroute)]
    assert moves == [("g5.e0", "standalone"), ("g6.e0", "cell:2")]


def test_oversampling_spares_in_dispatch_index_order(driver):
    d = driver(make_policy(P(K=2, C_e=10, N=2, B=1, k_spare=1, rho_min=1.0)))
    d.finish("g0.e2")  # the spare finishes first: never used by completion order
    assert not d.of(GroupReady)
    d.finish("g0.e0", outcome="overall_timeout", status=None)  # excluded: the spare replaces it
    assert not d.of(GroupReady)
    d.finish("g0.e1")
    assert [x.group_id for x in d.of(GroupReady)] == ["g0"]
    assert not d.of(Cancel)


def test_unneeded_spare_cancelled_or_withdrawn(driver):
    d = driver(make_policy(P(K=2, C_e=10, N=2, B=1, k_spare=1, rho_min=1.0)))
    d.finish("g0.e0")
    d.finish("g0.e1")
    assert [(x.execution_id, x.reason) for x in d.of(Cancel)] == [("g0.e2", "surplus")]
    f = d.policy.ledger.f
    d.settle_cancels()
    assert d.policy.ledger.f == f + 1 and d.policy.ledger.cancelled_surplus == 1
    # a spare still queued when its group completes is withdrawn (x), never launched
    led = Ledger(N=2, N_d=3)
    led.dispatch()
    for _ in range(2):
        led.mark_launched(led.pop_queued(), "cell:0")
    for eid in ("g0.e0", "g0.e1"):
        led.terminated(eid, "completed")
    led.assessed("g0.e0", "valid")
    out = led.assessed("g0.e1", "valid")
    assert [x.execution_id for x in out if isinstance(x, Withdraw)] == ["g0.e2"]
    assert (led.x, led.withdrawn_surplus, led.queued, led.pop_queued()) == (1, 1, 0, None)


def test_drop_refills_immediately_with_priority(driver):
    d = driver(make_policy(P(K=1, C_e=2, N=2, B=1, phi=1.0, rho_min=1.0)))
    assert [x.spec.execution_id for x in d.of(Launch)] == ["g0.e0", "g0.e1"]
    out = d.finish("g0.e0", outcome="overall_timeout", status=None)
    assert [x.group_id for x in out if isinstance(x, GroupDropped)] == ["g0"]
    refill = [x for x in out if isinstance(x, Dispatch)]
    assert len(refill) == 1 and refill[0].refill and refill[0].v_d == 0
    assert [x.execution_id for x in out if isinstance(x, Cancel)] == ["g0.e1"]
    launched = [x.spec.execution_id for x in out if isinstance(x, Launch)]
    assert launched == ["g2.e0"]  # the refill jumps the queue ahead of g1
    d.settle_cancels()
    assert d.of(Launch)[-1].spec.execution_id == "g2.e1"
    assert d.policy.effective_waterlevel() == d.policy.ledger.waterlevel  # nothing of the refill ended yet


def test_continuous_dispatch_releases_slot_on_ready(driver):
    d = driver(make_policy(P(K=2, C_e=10, N=1, B=1, dispatch="continuous", q_c=2, rho_min=1.0, tau_s=1e9)))
    assert d.policy.ledger.d == 2
    out = d.finish("g0.e0")
    assert [x.group_id for x in out if isinstance(x, Dispatch)] == ["g2"]


def test_colocate_switches_when_admitted_finished(driver):
    d = driver(make_policy(P(kind="colocate", K=2, C_e=2, N=1, B=1, mu=2)))
    d.finish("g0.e0")
    assert not d.of(BeginTransition)
    d.finish("g1.e0")
    assert sorted(x.cell for x in d.of(BeginTransition)) == [0, 1]
    d.finish_transitions()
    assert d.of(OpenBatch)


def test_colocate_phi_with_standalone_pool(driver):
    d = driver(make_policy(P(kind="colocate", K=2, C_e=2, C_s=1, N=1, B=2, mu=1, phi=0.5)))
    d.finish("g0.e0")  # standalone slot
    d.finish("g1.e0")  # ready = mu*B and 1 running <= C_s: switch, g2 moves to the standalone pool
    assert sorted(x.cell for x in d.of(BeginTransition)) == [0, 1]
    assert [(x.execution_id, x.engine) for x in d.of(Reroute)] == [("g2.e0", "standalone")]
    with pytest.raises(ValueError, match="standalone"):
        P(kind="colocate", phi=1.0)


def test_async_fixed_split(driver):
    d = driver(make_policy(P(kind="async", K=3, C_e=2, N=1, B=1, async_train_cells=1)))
    assert d.policy.roles == [CellRole.TRAINING, CellRole.ROLLOUT, CellRole.ROLLOUT]
    assert d.policy.capacity() == 4 and d.of(OpenBatch)
    d.finish("g0.e0")
    d.send(GroupAssigned("g0"))
    d.send(MicrostepClaimed(0, "g0"))
    d.send(StepDone(1))
    d.send(PublishDone(1))
    assert not d.of(BeginTransition) and d.policy.roles[0] is CellRole.TRAINING


def test_rejects_contradictory_events(driver):
    d = driver(make_policy(P(K=2, C_e=10, N=1, B=1, rho_min=1.0, tau_s=1e9)))
    d.finish("g0.e0")
    from gyre_sched.events import Terminated

    with pytest.raises(InvariantError, match="terminates once"):
        d.send(Terminated("g0.e0", "completed"))
    with pytest.raises(InvariantError, match=r"not in the open batch|while rollout"):
        d.send(MicrostepClaimed(1, "g0"))
