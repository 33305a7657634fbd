"""Seeded discrete-event simulator that drives the same policy objects as a real controller, on a simulated clock.

The simulator plays every other party: the execution runner (launch/cancel/terminate from the workload plan), the
evaluator (assessment delays and failures), the cells (switch costs, satellite joins), publication, and the training
pipeline (micro-step claims, 1F1B start-up and drain per cell per batch, optimizer update, broadcast).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import IO, Any

from gyre_sched.config import SimConfig
from gyre_sched.diagnostics import BurstLog
from gyre_sched.events import (
    Assessed,
    BeginTransition,
    Cancel,
    CompletePublish,
    Decision,
    Dispatch,
    EndTransition,
    EnginesLoaded,
    Event,
    GroupAssigned,
    GroupReady,
    Launch,
    Launched,
    MicrostepClaimed,
    OpenBatch,
    Publish,
    PublishDone,
    Reroute,
    StepDone,
    StepRecorded,
    Terminated,
    Tick,
    TransitionDone,
)
from gyre_sched.faults import FaultPlan, FaultPlaying
from gyre_sched.policies import make_policy
from gyre_sched.policy import PolicyCore
from gyre_sched.trace import TraceWriter, policy_header
from gyre_sched.types import CellRole
from gyre_sched.workload import ExecPlan, make_workload


@dataclass
class SimResult:
    policy: str
    end_time_s: float
    steps: int
    staleness: list[int]
    staleness_refill: list[bool]
    mean_staleness: float
    mean_staleness_steady: float
    """Excluding warm-up bursts and refill groups (eq. 2 holds only without drops)."""
    max_staleness: int
    role_share: dict[str, float]
    counters: dict[str, int]
    events: int
    wall_s: float
    samples: list[tuple[float, int, int, int]] = field(default_factory=list, repr=False)
    step_end_s: list[float] = field(default_factory=list, repr=False)
    """Simulated time at which each optimizer step ended."""
    time_use: dict[str, float] = field(default_factory=dict)
    """Training busy and training-role cell-time, rollout busy and idle slot-time, train slack, exposed training
    (``gyre_sched.diagnostics``)."""
    cost_basis: dict[str, Any] = field(default_factory=dict)
    """The training cost's basis and what it comes to (``CostConfig.basis``)."""
    bursts: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """Per burst: ``gyre_sched.diagnostics.Burst`` rows (bursts.jsonl)."""

    def summary(self) -> dict[str, Any]:
        skip = ("staleness", "staleness_refill", "samples", "step_end_s", "bursts")
        return {k: v for k, v in self.__dict__.items() if k not in skip}


@dataclass
class _Batch:
    version: int
    final: bool
    assigned: int = 0
    todo: list[str] = field(default_factory=list)  # unclaimed micro-steps (group ids), claimed from the end
    done: int = 0
    participants: set[int] = field(default_factory=set)
    finishing: bool = False


class Simulator(FaultPlaying):
    """``Simulator(cfg).run()``; ``trace_stream`` records trace.jsonl, ``deep_checks`` recounts after each event,
    ``faults`` plays cell faults and their recovery (``gyre_sched.faults``)."""

    def __init__(
        self,
        cfg: SimConfig,
        *,
        trace_stream: IO[bytes] | None = None,
        deep_checks: bool = False,
        record_samples: bool = False,
        faults: FaultPlan | None = None,
    ) -> None:
        self.cfg = cfg
        self.params = cfg.policy_params()
        self.policy: PolicyCore = make_policy(self.params, deep_checks=deep_checks)
        self.workload = make_workload(cfg.workload, cfg.seed)
        query_of = getattr(self.workload, "query_of", None)
        if cfg.workload.query_pool and query_of is not None:  # recurring queries: the policy sees which query
            self.policy.ledger.query_of = lambda seq: f"q{query_of(seq)}"
        self._trace_stream = trace_stream
        self.trace: TraceWriter | None = None
        self.record_samples = record_samples
        self.samples: list[tuple[float, int, int, int]] = []
        self.now = 0.0
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0
        self._token: dict[str, int] = {}  # execution -> live termination token
        self._end: dict[str, float] = {}
        self._plans: dict[str, ExecPlan] = {}
        self._reroutes: dict[str, int] = {}
        self._group_seq: dict[str, int] = {}
        self._busy: set[int] = set()
        self._warm: set[int] = set()  # cells past their one-off warm-up
        self._started_batch: dict[int, int] = {}
        self._batch: _Batch | None = None
        self._tick_at: float | None = None
        self._steps = 0
        self._step_ends: list[float] = []
        self._events = 0
        self._role_since = [0.0] * self.params.K
        # Without faults no cell dies: no LOST share.
        self._role_time = {r.value: 0.0 for r in CellRole if r is not CellRole.LOST or faults is not None}
        self.costs = cfg.costs()
        self._ms_s = self.costs.microstep_s
        self.bursts = BurstLog(self.params.K, self.params.C_e)
        self._init_faults(faults)

    def header(self) -> dict[str, Any]:
        return {
            **policy_header(self.params),
            "seed": self.cfg.seed,
            "source": "gyre-sched simulator",
            "initial_roles": [r.value for r in self.policy.roles],
        }

    # ---- event plumbing -------------------------------------------------------------------------------------------
    def _at(self, t: float, item: Any) -> None:
        if t < self.now:
            raise RuntimeError(f"simulator bug: {item!r} scheduled at t={t} before now={self.now}")
        heapq.heappush(self._heap, (t, self._seq, item))
        self._seq += 1

    def _deliver(self, ev: Event) -> None:
        version = self.policy.version
        out = self.policy.handle(ev, self.now)
        self._events += 1
        if self.trace:
            self.trace.event(self.now, ev, version=version)
        self._execute(out)

    def _execute(self, out: list[Decision]) -> None:
        if self.trace:
            self.trace.decisions(self.now, out)
        c = self.costs
        for d in out:
            match d:
                case Dispatch(gid, _, _, v_d, refill):
                    self._group_seq[gid] = int(gid[1:])
                    self.bursts.dispatched(self.now, v_d, refill)
                case GroupReady(gid):
                    self.bursts.group_ready(self.now, gid)
                case Launch(spec):
                    eid = spec.execution_id
                    plan = self.workload.plan(self._group_seq[spec.group_id], spec.dispatch_index)
                    self._plans[eid] = plan
                    self._arm(eid, self.now + plan.duration_s)
                    self._at(self.now, Launched(eid))
                case Cancel(eid, _):
                    self._token[eid] = -1  # the natural termination will not fire
                    self._at(self.now + self.cfg.workload.cancel_latency_s, ("cancelled", eid))
                case Reroute(eid, _):
                    n = self._reroutes[eid] = self._reroutes.get(eid, 0) + 1
                    # a recorded duration already includes what its recorded reroutes cost
                    if (
                        self._token.get(eid, -1) >= 0
                        and n > self._plans[eid].reroutes
                        and c.reroute_penalty_s
                    ):
                        self._arm(eid, self._end[eid] + c.reroute_penalty_s)
                case BeginTransition(cell, _, to):
                    self._role_change(cell)
                    if to is CellRole.TO_TRAINING:
                        self.bursts.sent_to_training(self.now, cell)
                        cost = c.switch_to_training_s + (c.satellite_join_s if cell else 0.0)
                    else:
                        cost = c.switch_to_rollout_s
                    self._at(self.now + cost, ("switched", cell, self._epoch[cell]))
                case EndTransition(cell, _, to):
                    self._role_change(cell)
                    if to is CellRole.TRAINING:
                        led = self.policy.ledger
                        self.bursts.joined_training(self.now, cell, led.running, len(led.ready))
                case Publish(v):
                    self._fault_decision(d)
                    self._at(self.now + c.publish_s, EnginesLoaded(v))
                case CompletePublish(v):
                    self.bursts.published(self.now, v)
                    self._deliver(PublishDone(v))
                case OpenBatch(v):
                    self._batch = _Batch(v, final=self.policy.step_in_burst == self.policy.mu_now - 1)
                case StepRecorded(v, groups, _):
                    self._steps = v
                    self._step_ends.append(self.now)
                    self.bursts.step(self.now, v, list(groups))
                case _:
                    self._fault_decision(d)

    def _arm(self, eid: str, end: float) -> None:
        tok = self._token.get(eid, 0) + 1
        self._token[eid], self._end[eid] = tok, end
        self._at(end, ("term", eid, tok))

    def _role_change(self, cell: int) -> None:
        # called with the new role already applied: account the span of the previous role
        role = self._prev_roles[cell]
        self._role_time[role] += self.now - self._role_since[cell]
        self._role_since[cell], self._prev_roles[cell] = self.now, self.policy.roles[cell].value

    # ---- training pipeline ----------------------------------------------------------------------------------------
    def _train(self) -> None:
        b, p = self._batch, self.params
        if b is None or b.finishing:
            return
        for cell in range(p.K):
            if cell in self._busy or cell in self._dead or self.policy.roles[cell] is not CellRole.TRAINING:
                continue
            if cell not in self._warm and (b.todo or self.policy.ledger.ready):
                # a cell's first claim of the run waits for its warm-up (load, first kernels)
                self._warm.add(cell)
                if self.costs.warmup_s > 0:
                    self._busy.add(cell)
                    self._at(self.now + self.costs.warmup_s, ("warm", cell))
                    continue
            if not b.todo and b.assigned < p.B:
                ready = self.policy.ledger.ready_unassigned()
                take = ready[:1] if p.streaming else (ready[: p.B] if len(ready) >= p.B - b.assigned else [])
                for g in take:
                    self._deliver(GroupAssigned(g.id))
                    b.assigned += 1
                    b.todo[:0] = [g.id] * self.costs.microsteps_per_group
            if not b.todo:
                break
            gid = b.todo.pop()
            self._deliver(MicrostepClaimed(cell, gid))
            self.bursts.claimed(self.now, b.version)
            dur = self._ms_s
            if self._started_batch.get(cell) != b.version:
                self._started_batch[cell] = b.version
                dur += self.costs.pipeline_startup_s

            b.participants.add(cell)
            self._busy.add(cell)
            self.bursts.trained(dur)
            self._at(self.now + dur, ("ms", cell, b.version, self._epoch[cell]))
            if not self._claimed(cell, gid):
                continue  # it died right after its claim

    def _ms_done(self, cell: int, version: int, epoch: int) -> None:
        if self._epoch[cell] != epoch:
            return  # it died meanwhile: the micro-step was requeued
        self._busy.discard(cell)
        self._doing.pop(cell, None)
        b = self._batch
        if b is None or b.version != version:
            return
        b.done += 1
        if b.assigned == self.params.B and b.done == self.params.B * self.costs.microsteps_per_group:
            b.finishing = True
            c = self.costs
            extra = c.broadcast_s if (not b.final and len(b.participants) > 1) else 0.0
            extra += self._reduce_hangs(version, b.participants)
            self.bursts.trained(len(b.participants) * (c.pipeline_drain_s + c.optimizer_s + extra))
            self._at(self.now + c.pipeline_drain_s + c.optimizer_s + extra, StepDone(version + 1))

    # ---- main loop ------------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall = time.perf_counter()
        self._prev_roles = [CellRole.ROLLOUT.value] * self.params.K
        out = self.policy.start(0.0)
        self._prev_roles = [r.value for r in self.policy.roles]
        if self._trace_stream is not None:  # the header records the roles the policy started with
            self.trace = TraceWriter(self._trace_stream, self.header())
        self._execute(out)
        self._after()
        target = self.cfg.steps
        while self._heap and self._steps < target:
            t, _, item = heapq.heappop(self._heap)
            self.now = t
            if isinstance(item, tuple):
                kind = item[0]
                if kind == "term":
                    _, eid, tok = item
                    if self._token.get(eid) != tok:
                        continue
                    self._token[eid] = -1
                    plan = self._plans[eid]
                    self._deliver(Terminated(eid, plan.outcome))
                    if plan.outcome not in ("overall_timeout", "stalled"):
                        self._at(self.now + plan.assess_delay_s, Assessed(eid, plan.status))
                elif kind == "cancelled":
                    self._deliver(Terminated(item[1], "cancelled"))
                elif kind == "ms":
                    self._ms_done(item[1], item[2], item[3])
                elif kind == "warm":
                    self._busy.discard(item[1])
                elif kind == "switched":
                    if self._epoch[item[1]] == item[2] and item[1] not in self._dead:
                        self._deliver(TransitionDone(item[1]))
                else:
                    self._fault_item(item)
            elif isinstance(item, Assessed):
                g = self.policy.ledger.groups[self.policy.ledger.execs[item.execution_id].group]
                if g.state.value == "open":  # an evaluator result for a settled group changes nothing
                    self._deliver(item)
            elif isinstance(item, StepDone):
                self._batch = None
                self._deliver(item)
            elif isinstance(item, Tick):
                self._tick_at = None
                self._deliver(item)
            else:
                self._deliver(item)
            self._after()
        for cell in range(self.params.K):
            self._role_time[self._prev_roles[cell]] += self.now - self._role_since[cell]
        if self._steps < target:
            raise RuntimeError(
                f"simulation stalled after {self._steps} steps at t={self.now:.0f}s (deadlock)"
            )
        return self._result(time.perf_counter() - wall)

    def _after(self) -> None:
        self._train()
        led, pol = self.policy.ledger, self.policy
        training = sum(r is CellRole.TRAINING for r in pol.roles)
        self.bursts.advance(
            self.now, queued=led.queued, running=led.running, capacity=pol.capacity(), training=training
        )
        if self.record_samples:
            led = self.policy.ledger
            self.samples.append((self.now, led.waterlevel, self.policy.capacity(), led.running))
        wake = self.policy.next_wakeup()
        if wake is not None and self._tick_at != wake:
            self._tick_at = wake
            self._at(wake, Tick())

    def _result(self, wall_s: float) -> SimResult:
        pol, led, cfg = self.policy, self.policy.ledger, self.cfg
        st, rf = pol.staleness, pol.staleness_refill
        skip = cfg.warmup_bursts * self.params.mu * self.params.B
        steady = [s for s, r in zip(st[skip:], rf[skip:], strict=True) if not r]
        total = sum(self._role_time.values()) or 1.0
        return SimResult(
            policy=self.params.kind,
            end_time_s=self.now,
            steps=self._steps,
            staleness=list(st),
            staleness_refill=list(rf),
            mean_staleness=sum(st) / len(st),
            mean_staleness_steady=sum(steady) / len(steady) if steady else float("nan"),
            max_staleness=max(st),
            role_share={k: v / total for k, v in self._role_time.items()},
            counters={
                "d": led.d,
                "p": led.p,
                "f": led.f,
                "x": led.x,
                "dropped_groups": led.dropped,
                "cancelled_surplus": led.cancelled_surplus,
                "withdrawn_surplus": led.withdrawn_surplus,
                "claims_while_elastic_cells_ran_executions": pol.claims_while_running,
            },
            events=self._events,
            wall_s=wall_s,
            samples=self.samples,
            step_end_s=list(self._step_ends),
            time_use=self.bursts.totals(self.now),
            cost_basis=cfg.cost.basis(nodes_per_cell=cfg.cluster.nodes_per_cell, N=self.params.N),
            bursts=[b.row() for b in self.bursts.bursts],
        )


def simulate(cfg: SimConfig, **kw: Any) -> SimResult:
    return Simulator(cfg, **kw).run()
