"""A satellite cell lost mid-run (CellLost), restarted (CellRestored), and a policy resumed at a checkpointed version
(resume_at), with the interrupted run's untrained groups carried over, ready or open."""

from __future__ import annotations

import io

import orjson
import pytest

from gyre_sched.config import PolicyParams
from gyre_sched.errors import InvariantError
from gyre_sched.events import (
    BeginTransition,
    CellLost,
    CellRestarted,
    CellRestored,
    CellUntrained,
    Dispatch,
    GroupAssigned,
    GroupDropped,
    Launch,
    MicrostepClaimed,
    OpenBatch,
    Reroute,
    StepDone,
    StepRecorded,
    Tick,
    TransitionDone,
    WeightsLoaded,
)
from gyre_sched.ledger import CarriedGroup
from gyre_sched.policies import make_policy
from gyre_sched.trace import TraceWriter, summarize_trace
from gyre_sched.types import CellRole, TraceLine


def params(**kw) -> PolicyParams:
    base = dict(kind="elastic", K=3, C_e=2, N=2, B=2, phi=0.5, mu=1, rho_min=0.5, tau_s=0.0)
    return PolicyParams(**{**base, **kw})


def restartable(policy):
    policy.health.restarts = True
    return policy


def restore(d, cell: int) -> list:
    """The restart and the load the cell-health machine decides, reported done: the cell serves, rollout-only."""
    d.send(CellRestarted(cell), dt=1.0)
    return d.send(WeightsLoaded(cell, d.policy.ledger.published), dt=1.0)


def facts(d, *found) -> list:
    """What the cell-health machine finds at a boundary (a re-form formed or failed), applied to the roles; the
    machine's own path there is tested in test_health.py and test_faults_sim.py."""
    return d._apply(d.policy._health_facts(list(found))) + d.send(Tick())


def test_lost_rollout_cell_moves_its_executions_to_free_slots(driver):
    d = driver(make_policy(params(phi=0.0), deep_checks=True))  # 4 executions, 6 slots: cell 0 has 2 free
    on_cell2 = sorted(x.spec.execution_id for x in d.of(Launch) if x.spec.engine == "cell:2")
    assert len(on_cell2) == 2 and d.policy.capacity() == 6
    out = d.send(CellLost(2), dt=1.0)
    moved = [x for x in out if isinstance(x, Reroute)]
    assert sorted(x.execution_id for x in moved) == on_cell2 and {x.engine for x in moved} == {"cell:0"}
    assert d.policy.roles[2] is CellRole.LOST and d.policy.capacity() == 4 and not d.cancelled
    assert d.send(CellLost(2)) == []  # reported twice (pump and a failed call): once


def test_lost_cell_executions_are_cancelled_without_a_free_slot(driver):
    d = driver(make_policy(params(phi=1.0), deep_checks=True))  # 8 executions, 6 slots: all full
    on_cell2 = sorted(x.spec.execution_id for x in d.of(Launch) if x.spec.engine == "cell:2")
    d.send(CellLost(2), dt=1.0)
    assert sorted(d.cancelled) == on_cell2
    d.settle_cancels()
    assert not d.policy.load["cell:2"] and d.policy.ledger.running == 4


def test_groups_of_cancelled_executions_settle_and_the_burst_trains(driver):
    """Executions cancelled because their cell was lost with no free slot are never assessed: their groups are
    dropped (no spare) and refilled at once, so every group of the burst settles. Before, such a group stayed open
    for good and the burst's step never came (a `gyre run` whose satellite stopped answering hung)."""
    d = driver(make_policy(params(phi=1.0), deep_checks=True))  # 8 executions, 6 slots: all full
    on_cell2 = sorted(x.spec.execution_id for x in d.of(Launch) if x.spec.engine == "cell:2")
    hit = {eid.split(".")[0] for eid in on_cell2}
    d.send(CellLost(2), dt=1.0)
    d.settle_cancels()
    refills = [x for x in d.of(Dispatch) if x.refill]
    assert len(refills) == len(hit)  # one refill per group that lost an execution
    assert {x.group_id for x in d.of(GroupDropped)} == hit
    assert all(d.policy.ledger.groups[g].state.value == "dropped" for g in hit)
    for _ in range(20):  # finish whatever runs (refills launch as slots free); the step comes
        for eid in list(d.running):
            d.finish(eid)
        d.finish_transitions()
        d.send(Tick(), dt=1.0)
        if d.policy.ledger.ready:
            break
    assert len(d.policy.ledger.ready) >= 2, "the burst's groups never became ready"
    assert not any(x.status == "excluded" for x in d.policy.ledger.execs.values() if x.outcome != "cancelled")


def test_elastic_prefix_skips_the_lost_cell(driver):
    d = driver(make_policy(params(phi=0.0), deep_checks=True))
    d.send(CellLost(1), dt=1.0)  # its two executions move to cell 0
    # both groups become ready: the core joins, then the next live cell (2, not 1)
    for eid in list(d.running):
        d.finish(eid)
        d.finish_transitions()
    for _ in range(3):
        d.send(Tick(), dt=1.0)
        d.finish_transitions()
    joined = [x.cell for x in d.of(BeginTransition) if x.to_role is CellRole.TO_TRAINING]
    assert joined == [0, 2]
    assert d.policy.roles == [CellRole.TRAINING, CellRole.LOST, CellRole.TRAINING]
    assert d.send(TransitionDone(1)) == []  # a lost cell's late report is ignored


def test_a_claim_heard_after_its_cells_loss_is_ignored(driver):
    """CI's interleaving (ci-17, test_a_cell_lost_for_good_does_not_block_another_cells_rejoin): a training satellite
    claims a micro-step and dies; the core's report of the claim reaches the policy after the satellite's own stream
    ended in its loss. The claim is history from before the loss (the trainer requeues it), not a broken invariant:
    before, the guard sat below the claim's own case and the run failed with 'cell 2 claimed a micro-step while
    lost'."""
    d = driver(make_policy(params(phi=0.0), deep_checks=True))
    for eid in list(d.running):  # both groups ready: the core joins, then cell 1
        d.finish(eid)
        d.finish_transitions()
    for _ in range(3):
        d.send(Tick(), dt=1.0)
        d.finish_transitions()
    assert d.policy.roles[1] is CellRole.TRAINING and d.policy.batch == []
    gid = sorted(d.policy.ledger.ready)[0]
    d.send(GroupAssigned(gid))
    d.send(CellLost(1), dt=1.0)
    assert d.send(MicrostepClaimed(1, gid)) == [] and d.policy.roles[1] is CellRole.LOST


def test_a_restored_cell_serves_again_and_trains_only_once_trainable(driver):
    d = driver(restartable(make_policy(params(phi=1.0), deep_checks=True)))  # 8 executions, 6 slots: all full
    d.send(CellLost(1), dt=1.0)
    d.settle_cancels()  # its executions were cancelled (no free slot); their groups' refills queue
    assert d.policy.capacity() == 4 and d.policy.ledger.queued > 0
    out = restore(d, 1)  # rollout-only: back in the capacity, queued work launches on it
    assert d.policy.roles[1] is CellRole.ROLLOUT and d.policy.capacity() == 6
    assert [x.spec.engine for x in out if isinstance(x, Launch)] == ["cell:1", "cell:1"]
    assert d.policy.trainable() == [0, 2]
    for eid in list(d.running):  # every group ready: the core joins, then cell 2 (1 cannot train)
        d.finish(eid)
        d.finish_transitions()
    for _ in range(3):
        d.send(Tick(), dt=1.0)
        d.finish_transitions()
    joined = [x.cell for x in d.of(BeginTransition) if x.to_role is CellRole.TO_TRAINING]
    assert 1 not in joined
    facts(d, CellRestored(1, trains=True))  # its training side rejoined: trainable once cell 2 is out
    assert d.policy.trainable() == [0, 2] and d.policy.roles[2] is CellRole.TRAINING
    d.send(CellLost(2), dt=1.0)
    assert d.policy.trainable() == [0, 1]
    with pytest.raises(InvariantError, match="restored"):
        facts(d, CellRestored(0))  # never lost
    with pytest.raises(InvariantError, match="restarted while serving"):
        d.send(CellRestarted(0))  # never lost


def test_live_satellites_without_a_training_world_serve_and_train_again_after_the_next_reform(driver):
    """A re-form of the gloo world failed (a cell never arrived): the live satellites keep serving rollout but no
    decision sends them to training until `CellRestored(trains=True)` (the next re-form); the core trains alone."""
    d = driver(make_policy(params(phi=0.0), deep_checks=True))
    facts(d, CellUntrained(1), CellUntrained(2))
    assert d.policy.roles == [CellRole.ROLLOUT] * 3 and d.policy.capacity() == 6
    assert d.policy.trainable() == [0]
    for eid in list(d.running):
        d.finish(eid)
        d.finish_transitions()
    for _ in range(3):
        d.send(Tick(), dt=1.0)
        d.finish_transitions()
    assert [x.cell for x in d.of(BeginTransition) if x.to_role is CellRole.TO_TRAINING] == [0]
    facts(d, CellRestored(1, trains=True), CellRestored(2, trains=True))
    assert d.policy.trainable() == [0, 1, 2]
    with pytest.raises(InvariantError, match="core or lost"):
        facts(d, CellUntrained(0))
    d.send(CellLost(2), dt=1.0)
    with pytest.raises(InvariantError, match="core or lost"):
        facts(d, CellUntrained(2))


def test_async_keeps_its_split_a_restored_training_satellite_idles_then_trains_again(driver):
    """Async, K=3, cells 0 and 1 train: cell 1 lost and restarted takes no rollout work (eq. 3's capacity leaves it
    out) until its training side is back, then switches to training again; a failed re-form sends a training
    satellite out of training to wait the same way."""
    d = driver(restartable(make_policy(params(kind="async", async_train_cells=2, phi=1.0), deep_checks=True)))
    assert d.policy.roles == [CellRole.TRAINING, CellRole.TRAINING, CellRole.ROLLOUT]
    assert d.policy.capacity() == 2
    d.send(CellLost(1), dt=1.0)
    restore(d, 1)  # serving the published weights, no training side yet
    assert d.policy.roles[1] is CellRole.ROLLOUT and d.policy.capacity() == 2
    for eid in list(d.running)[:1]:  # a slot frees: the launch goes to cell 2, never to the waiting cell 1
        d.finish(eid)
    assert {x.spec.engine for x in d.of(Launch)} == {"cell:2"}
    assert not d.of(BeginTransition)
    out = facts(d, CellRestored(1, trains=True))  # the world re-formed with it
    assert [(x.cell, x.to_role) for x in out if isinstance(x, BeginTransition)] == [(1, CellRole.TO_TRAINING)]
    d.finish_transitions()
    assert d.policy.roles == [CellRole.TRAINING, CellRole.TRAINING, CellRole.ROLLOUT]
    assert d.policy.trainable() == [0, 1, 2] and d.policy.capacity() == 2
    out = facts(d, CellUntrained(1))  # a later re-form failed: no world to reduce in
    assert [(x.cell, x.to_role) for x in out if isinstance(x, BeginTransition)] == [(1, CellRole.TO_ROLLOUT)]
    d.finish_transitions()
    assert d.policy.roles[1] is CellRole.ROLLOUT and d.policy.capacity() == 2
    assert d.policy.trainable() == [0, 2]


def test_the_core_cannot_be_lost(driver):
    d = driver(make_policy(params()))
    with pytest.raises(InvariantError, match="core"):
        d.send(CellLost(0))


def test_resume_at_numbers_groups_after_the_interrupted_run():
    policy = make_policy(params())
    policy.resume_at(7, next_group=12)
    out = policy.start(0.0)
    dispatched = [x for x in out if isinstance(x, Dispatch)]
    assert dispatched[0].group_id == "g12" and all(x.v_d == 7 for x in dispatched)
    assert policy.version == 7
    with pytest.raises(InvariantError):
        policy.resume_at(8, next_group=20)


def test_trace_counts_the_resume_settlement_and_the_lost_cell():
    buf = io.BytesIO()
    w = TraceWriter(buf, {"K": 2, "C_e": 2, "C_s": 0, "N": 1, "B": 1, "phi": 0, "mu": 1})
    w.write(1.0, "dispatch", group="g0", executions=["g0.e0", "g0.e1"], v_d=0)
    w.write(1.0, "launch", execution="g0.e0")
    w.event(2.0, CellLost(1))
    w.decisions(2.5, [CellRestored(1)])
    w.event(2.6, CellLost(1))
    appended = TraceWriter.append_to(buf)
    appended.write(3.0, "resume", version=1, cancelled=["g0.e0"], withdrawn=["g0.e1"], roles=["rollout"] * 2)
    s = summarize_trace(orjson.loads(x) for x in buf.getvalue().splitlines())
    assert (s.d, s.p, s.f, s.x) == (2, 1, 1, 1)  # nothing of the interrupted part stays outstanding
    assert [r for _, _, r in s.roles[1]] == ["rollout", "lost", "rollout", "lost", "rollout"]
    assert s.role_share()["lost"] > 0


def test_run_end_names_what_it_cut_off_and_a_later_resume_settles_it_once():
    """The run's end (run_end) leaves the counters as the policy had them: the executions it cancelled and the queued
    ones are settled by the resume line that continues the run, counted once."""
    buf = io.BytesIO()
    w = TraceWriter(buf, {"K": 2, "C_e": 2, "C_s": 0, "N": 1, "B": 1, "phi": 0, "mu": 1})
    w.write(1.0, "dispatch", group="g0", executions=["g0.e0", "g0.e1"], v_d=0)
    w.write(1.0, "launch", execution="g0.e0")
    w.write(2.0, "run_end", version=1, steps=1, cancelled=["g0.e0"], withdrawn=["g0.e1"])
    lines = [orjson.loads(x) for x in buf.getvalue().splitlines()]
    for line in lines:
        TraceLine.model_validate(line)
    with pytest.raises(ValueError, match="run_end"):
        TraceLine.model_validate({"t": 2.0, "ev": "run_end", "version": 1, "steps": 1})
    s = summarize_trace(lines)
    assert (s.d, s.p, s.f, s.x) == (2, 1, 0, 0) and s.cut_off_at_end == ["g0.e0"]
    appended = TraceWriter.append_to(buf)
    appended.write(3.0, "resume", version=1, cancelled=["g0.e0"], withdrawn=["g0.e1"], roles=["rollout"] * 2)
    s = summarize_trace(orjson.loads(x) for x in buf.getvalue().splitlines())
    assert (s.d, s.p, s.f, s.x) == (2, 1, 1, 1)


def test_resume_carries_ready_groups_into_the_first_batch(driver):
    """The interrupted run's ready, untrained groups are held READY: the core joins on their supply, they fill the
    first batch (oldest version first) and are trained with their own staleness; the counters count only the resumed
    part's executions (deep checks compare every execution's state with them)."""
    policy = make_policy(params(phi=0.5), deep_checks=True)
    carried = [
        CarriedGroup("g4", "q4", 3, (("g4.e0", "valid"), ("g4.e1", "no_work"))),
        CarriedGroup("g2", "q2", 2, (("g2.e0", "valid"), ("g2.e1", "valid"))),
    ]
    policy.resume_at(3, next_group=6, carried=carried)
    d = driver(policy)
    assert d.of(Dispatch)[0].group_id == "g6" and policy.ledger.d == 6  # 1.5 * N_d * B, none carried
    assert policy.ledger.members("g4") == ["g4.e0", "g4.e1"] and policy.supply() == 2
    for eid in list(d.running)[
        :2
    ]:  # eq. 5: the 6 outstanding executions must fit the 4 slots of cells 1 and 2
        d.finish(eid, status=None)
    assert d.switching == {0}
    d.finish_transitions()
    assert [x.version for x in d.of(OpenBatch)] == [3]
    order = [g.id for g in policy.ledger.ready_unassigned()]
    assert order == ["g2", "g4"]  # oldest version first
    for gid in order:
        d.send(GroupAssigned(gid))
    out = d.send(StepDone(4))
    (recorded,) = [x for x in out if isinstance(x, StepRecorded)]
    assert recorded.groups == ("g2", "g4") and recorded.staleness == (1, 0)
    assert policy.ledger.carried == 4 and (policy.ledger.d, policy.ledger.p, policy.ledger.f) == (6, 6, 2)


def test_a_carried_open_group_gets_the_executions_it_lacks_first_and_counts_its_finished_ones(driver):
    """A group the interrupted run left open (one member assessed valid, one cancelled by the kill, N=2, one spare)
    is taken over open: the resumed run dispatches the one member it lacks plus a spare into it, numbered after
    the old ones, ahead of everything else; the finished member counts first (dispatch-index order), and the group
    keeps its old v_d, so its staleness is its oldest member's."""
    policy = make_policy(params(phi=0.5, k_spare=1), deep_checks=True)
    old = (("g4.e0", "valid"), ("g4.e1", "excluded"), ("g4.e2", "excluded"))
    policy.resume_at(3, next_group=6, carried=[CarriedGroup("g4", "q4", 1, old)])
    d = driver(policy)
    first, *rest = d.of(Dispatch)
    assert (first.group_id, first.execution_ids, first.v_d, first.carried) == (
        "g4",
        ("g4.e3", "g4.e4"),
        1,
        True,
    )
    assert rest[0].group_id == "g6" and not rest[0].carried
    launched = [x.spec for x in d.of(Launch)]
    assert [(x.execution_id, x.dispatch_index) for x in launched[:2]] == [("g4.e3", 3), ("g4.e4", 4)]
    # 1.5 * N_d * B new; the old three: not again
    assert policy.ledger.d == 2 + 9 and policy.ledger.carried == 3
    d.finish("g4.e4", status="valid")  # the spare finishes first; index order decides who counts
    assert policy.ledger.groups["g4"].state.value == "open"
    d.finish("g4.e3", status="no_work")
    assert policy.ledger.members("g4") == ["g4.e0", "g4.e3"]
    assert policy.ledger.groups["g4"].state.value == "ready"


def test_a_carried_open_group_is_dropped_and_refilled_when_its_new_members_fail(driver):
    policy = make_policy(params(phi=0.5), deep_checks=True)  # no spares
    policy.resume_at(3, next_group=6, carried=[CarriedGroup("g4", "q4", 2, (("g4.e0", "valid"),))])
    d = driver(policy)
    assert d.of(Dispatch)[0].execution_ids == ("g4.e1",)
    d.finish("g4.e1", outcome="overall_timeout", status=None)
    assert [x.group_id for x in d.of(GroupDropped)] == ["g4"]
    refill = [x for x in d.of(Dispatch) if x.refill]
    assert len(refill) == 1 and refill[0].v_d == 3 and refill[0].group_id not in ("g4", "g6")


def test_a_carried_group_needs_a_usable_member_and_a_number_before_the_resumed_groups():
    policy = make_policy(params())
    with pytest.raises(InvariantError, match="numbered before"):
        policy.resume_at(3, next_group=6, carried=[CarriedGroup("g6", "q6", 3, (("g6.e0", "valid"),) * 2)])
    policy = make_policy(params())
    with pytest.raises(InvariantError, match="valid or no_work member"):
        members = (("g1.e0", "excluded"), ("g1.e1", "excluded"))
        policy.resume_at(3, next_group=6, carried=[CarriedGroup("g1", "q1", 3, members)])
