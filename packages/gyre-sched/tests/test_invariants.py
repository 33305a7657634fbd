"""Invariants under randomized event orders (hypothesis): the policy core is driven by an adversarial controller that
reports any event that is possible at that moment, in any order, with random outcomes and assessment results.
The core checks its invariants after every event (deep_checks recounts every execution), so any violation raises."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre_sched.config import PolicyParams
from gyre_sched.errors import InvariantError
from gyre_sched.events import (
    Assessed,
    BeginTransition,
    Cancel,
    GroupAssigned,
    Launch,
    MicrostepClaimed,
    OpenBatch,
    Publish,
    PublishDone,
    StepDone,
    Terminated,
    Tick,
    TransitionDone,
)
from gyre_sched.policies import make_policy
from gyre_sched.types import CellRole

OUTCOMES = ["completed", "completed", "completed", "failed", "harness_timeout", "overall_timeout"]
STATUSES = ["valid", "valid", "valid", "no_work", "excluded"]


@functools.lru_cache(maxsize=4096)
def _one_of(items: tuple) -> st.SearchStrategy:
    # built once per list: a fresh sampled_from for every draw (its checks and label) took a third of the test's time
    return st.sampled_from(items)


def pick(data, items):
    return data.draw(_one_of(tuple(items)))


def params(kind, streaming, k_spare, continuous, c_s, phi2, mu):
    if kind == "colocate":
        continuous, phi2 = False, (phi2 if c_s else 0)
    # elastic + continuous: as many groups in flight as the other cells hold (more is refused: training might never start)
    q_c = (2 * 3 + c_s) // (2 + k_spare) if continuous and kind == "elastic" else None
    return PolicyParams(
        kind=kind,
        K=3,
        C_e=3,
        C_s=c_s,
        N=2,
        B=2,
        phi=phi2 / 2,
        mu=mu,
        rho_min=0.5,
        tau_s=5.0,
        k_spare=k_spare,
        streaming=streaming,
        dispatch="continuous" if continuous else "boundary",
        q_c=q_c,
        async_train_cells=1,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["elastic", "async", "colocate"]),
    streaming=st.booleans(),
    k_spare=st.integers(0, 1),
    continuous=st.booleans(),
    c_s=st.sampled_from([0, 2]),
    phi2=st.integers(0, 2),
    mu=st.integers(1, 3),
    data=st.data(),
)
def test_invariants_under_random_event_orders(kind, streaming, k_spare, continuous, c_s, phi2, mu, data):
    p = params(kind, streaming, k_spare, continuous, c_s, phi2, mu)
    pol = make_policy(p, deep_checks=True)
    now = 0.0
    running: set[str] = set()
    to_assess: set[str] = set()
    switching: set[int] = set()
    publishing: list[int] = []
    batch_open = False
    claimed: set[str] = set()
    terminated_once: dict[str, int] = {}

    def apply(out):
        nonlocal batch_open
        for d in out:
            if isinstance(d, Launch):
                running.add(d.spec.execution_id)
            elif isinstance(d, Cancel):
                assert d.execution_id in running
            elif isinstance(d, BeginTransition):
                switching.add(d.cell)
                # a full batch's step may be running on the core: it stays in training until the step is reported
                full = pol.batch is not None and len(pol.batch) == p.B
                assert not (d.cell == 0 and d.from_role is CellRole.TRAINING and full), "core left"
            elif isinstance(d, Publish):
                publishing.append(d.version)
            elif isinstance(d, OpenBatch):
                batch_open = True

    apply(pol.start(now))
    for _ in range(data.draw(st.integers(50, 250), label="length")):
        actions = ["tick"]
        if running:
            actions.append("terminate")
        if to_assess:
            actions.append("assess")
        if switching:
            actions.append("transition")
        if publishing:
            actions.append("publish")
        training = [i for i, r in enumerate(pol.roles) if r is CellRole.TRAINING]
        if batch_open and pol.batch is not None and len(pol.batch) < p.B and pol.ledger.ready:
            actions.append("assign")
        if batch_open and training and pol.batch:
            actions.append("claim")
        if (
            batch_open
            and pol.batch is not None
            and len(pol.batch) == p.B
            and pol.roles[0] is CellRole.TRAINING
        ):
            actions.append("step")  # the core takes the step: only while it trains
        # the action and the time it takes in one draw: draws are what this test spends its time on
        act, dt = pick(data, [(a, dt) for a in actions for dt in (0.0, 1.0, 10.0)])
        now += dt
        if act == "terminate":
            eid = pick(data, sorted(running))
            outcome = pick(data, [*OUTCOMES, "cancelled"])
            running.discard(eid)
            terminated_once[eid] = terminated_once.get(eid, 0) + 1
            if outcome not in ("overall_timeout", "cancelled"):
                to_assess.add(eid)
            apply(pol.handle(Terminated(eid, outcome), now))
        elif act == "assess":
            eid = pick(data, sorted(to_assess))
            to_assess.discard(eid)
            apply(pol.handle(Assessed(eid, pick(data, STATUSES)), now))
        elif act == "transition":
            cell = pick(data, sorted(switching))
            switching.discard(cell)
            apply(pol.handle(TransitionDone(cell), now))
        elif act == "publish":
            apply(pol.handle(PublishDone(publishing.pop()), now))
        elif act == "assign":
            gid = pick(data, sorted(pol.ledger.ready))
            apply(pol.handle(GroupAssigned(gid), now))
        elif act == "claim":
            gid = pick(data, [g.id for g in pol.batch])
            claimed.add(gid)
            apply(pol.handle(MicrostepClaimed(pick(data, training), gid), now))
        elif act == "step":
            batch_open = False
            apply(pol.handle(StepDone(pol.version + 1), now))
        else:
            apply(pol.handle(Tick(), now))
        # invariants the core does not check itself
        assert all(n == 1 for n in terminated_once.values())
        if kind == "async":
            assert pol.roles[0] is CellRole.TRAINING and all(r is CellRole.ROLLOUT for r in pol.roles[1:])
        if kind == "colocate" and c_s == 0 and act == "claim":
            assert pol.ledger.running == 0  # never trains while an admitted execution runs
        led = pol.ledger
        assert 0 <= led.f <= led.p <= led.d - led.x
        assert led.running <= pol.capacity()


def test_a_step_reported_while_the_core_switches_is_refused():
    """The counterexample test_invariants found once (Colocate, streaming, mu = 1, phi = 0, C_s = 0, k_spare = 0):
    the generator reported a step while every cell, the core included, was still switching to training. The policy
    took it, published with the core mid-switch and then began the core's switch a second time ("transition of cell
    0 done while training"). The real system cannot report that step: g2 joined the batch while the pool was still
    switching, and its micro-steps are claimed only by training cells, after which the core takes the step. The
    generator reports a step only from a training core, and the policy refuses such a report at once with its cause."""
    p = params("colocate", streaming=True, k_spare=0, continuous=False, c_s=0, phi2=0, mu=1)
    pol = make_policy(p, deep_checks=True)
    pol.start(0.0)
    for eid in ("g0.e0", "g0.e1"):
        pol.handle(Terminated(eid, "completed"), 0.0)
        pol.handle(Assessed(eid, "valid"), 0.0)
    pol.handle(Terminated("g1.e0", "completed"), 0.0)
    out = pol.handle(Terminated("g1.e1", "completed"), 0.0)
    assert [d.cell for d in out if isinstance(d, BeginTransition)] == [0, 1, 2]
    for cell in (0, 1):
        pol.handle(TransitionDone(cell), 0.0)
    pol.handle(Assessed("g1.e0", "valid"), 0.0)
    assert any(isinstance(d, OpenBatch) for d in pol.handle(TransitionDone(2), 0.0))
    pol.handle(Assessed("g1.e1", "excluded"), 0.0)  # g1 dropped, g2 dispatched as its refill
    pol.handle(GroupAssigned("g0"), 0.0)  # streaming: the cells go back to rollout for the second group
    for cell in (0, 1, 2):
        pol.handle(TransitionDone(cell), 0.0)
    for eid in ("g2.e0", "g2.e1"):
        pol.handle(Terminated(eid, "completed"), 0.0)
    pol.handle(Assessed("g2.e0", "valid"), 0.0)
    out = pol.handle(Assessed("g2.e1", "valid"), 0.0)
    assert [d.cell for d in out if isinstance(d, BeginTransition)] == [0, 1, 2]
    pol.handle(GroupAssigned("g2"), 0.0)
    assert pol.roles[0] is CellRole.TO_TRAINING
    with pytest.raises(InvariantError, match="step 1 done while the core is to_training"):
        pol.handle(StepDone(1), 0.0)


def test_a_drop_beside_a_full_batch_keeps_the_pool_training_until_its_step():
    """The same failure's other cause (Colocate, streaming, mu = 2, C_s = 0): with the batch full, a group outside it
    dropped and its refill had no capacity, so the policy sent the whole pool back to rollout "starved" while the
    full batch's step ran on the core; the core's step then arrived mid-switch (refused since the check above, and
    before it, the core's switch was begun twice, as above). A full batch waits for no group: the pool stays, the
    step is taken, and the next batch, which lacks the refill, sends the pool back."""
    p = params("colocate", streaming=True, k_spare=0, continuous=False, c_s=0, phi2=0, mu=2)
    pol = make_policy(p, deep_checks=True)
    pol.start(0.0)  # g0..g3, capacity 9 for their 8 executions
    for eid in [f"g{g}.e{e}" for g in range(4) for e in range(2)]:
        pol.handle(Terminated(eid, "completed"), 0.0)
    pol.handle(Assessed("g0.e0", "valid"), 0.0)
    out = pol.handle(Assessed("g0.e1", "valid"), 0.0)
    assert [d.cell for d in out if isinstance(d, BeginTransition)] == [0, 1, 2]
    for cell in (0, 1, 2):
        pol.handle(TransitionDone(cell), 0.0)
    pol.handle(GroupAssigned("g0"), 0.0)
    pol.handle(Assessed("g1.e0", "valid"), 0.0)
    pol.handle(Assessed("g1.e1", "valid"), 0.0)
    pol.handle(GroupAssigned("g1"), 0.0)  # the batch is full: the core trains it to its step
    # g2 dropped, its refill queued with no capacity left
    out = pol.handle(Assessed("g2.e0", "excluded"), 0.0)
    assert not [d for d in out if isinstance(d, BeginTransition)]
    assert pol.roles == [CellRole.TRAINING] * 3
    out = pol.handle(StepDone(1), 0.0)
    assert [d.cell for d in out if isinstance(d, BeginTransition)] == [0, 1, 2]  # batch 1 lacks the refill
    assert pol.version == 1 and pol.batch == [] and pol.roles == [CellRole.TO_ROLLOUT] * 3
