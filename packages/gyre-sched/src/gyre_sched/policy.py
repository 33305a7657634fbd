"""The event-driven policy core (docs/design/scheduling.md) and its three policies: Elastic, Async, Colocate.

``decisions = policy.handle(event, now)``: no I/O, no clock reads. The base class owns what every policy shares:
dispatch accounting (``Ledger``), cell roles, capacity (eq. 3), launches (eq. 4) and engine routes, batches and steps,
staleness, burst end (satellites return, publication, dispatch of mu*N_d*B) and the invariants, checked after every
event. Subclasses decide only when cells change role.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre_sched.config import PolicyParams
from gyre_sched.errors import InvariantError
from gyre_sched.events import (
    Assessed,
    AssessmentRecorded,
    BeginTransition,
    BurstPlanned,
    CellLost,
    CellRestarted,
    CellRestartFailed,
    CellRestored,
    CellUntrained,
    CollectiveFailed,
    Decision,
    EndTransition,
    EnginesLoaded,
    Event,
    GroupAssigned,
    Join,
    Launch,
    Launched,
    MicrostepClaimed,
    OpenBatch,
    Publish,
    PublishDone,
    Reroute,
    SatelliteBurstEnded,
    StepDone,
    StepRecorded,
    Terminated,
    Tick,
    TransitionDone,
    WeightsLoaded,
    WeightsLoadFailed,
    WorldFailed,
    WorldFormed,
)
from gyre_sched.health import CellHealth
from gyre_sched.launch_order import DurationPredictor
from gyre_sched.launch_order import install as install_predicted_order
from gyre_sched.ledger import CarriedGroup, ExecState, Group, Ledger
from gyre_sched.planner import BurstPlan, make_planner
from gyre_sched.types import CellRole, ExecutionSpec, next_role

STANDALONE = "standalone"


def cell_engine(i: int) -> str:
    return f"cell:{i}"


class PolicyCore:
    """Shared machinery; see module docstring. ``deep_checks`` recounts every execution after each event (tests)."""

    kind = "base"

    def __init__(self, params: PolicyParams, *, deep_checks: bool = False) -> None:
        self.params = params
        self.deep_checks = deep_checks
        self.ledger = Ledger(
            N=params.N,
            N_d=params.N_d,
            continuous=params.dispatch == "continuous",
            idle_spares=params.spares == "idle",
        )
        self.planner = make_planner(params)
        self.predictor: DurationPredictor | None = None
        if params.launch_order == "predicted":  # learns from this policy's own launches and terminations only
            self.predictor = DurationPredictor()
            install_predicted_order(self.ledger, self.predictor)
        self.mu_now = params.mu  # this burst's steps (the adaptive planner chooses per burst)
        self.k_now = params.k_spare  # spares of groups dispatched now (refills too)
        self.roles = [CellRole.ROLLOUT] * params.K
        self._k = 0  # cells not in ROLLOUT, recounted on every role change (hot path)
        self._dest: list[str] = []
        self._cell_engines = [cell_engine(i) for i in range(params.K)]
        self.load: dict[str, set[str]] = {e: set() for e in self._cell_engines}
        if params.C_s:
            self.load[STANDALONE] = set()
        self.version = 0  # optimizer steps taken
        self.step_in_burst = 0
        self.batch: list[Group] | None = None  # groups of the open batch (None: no batch open)
        self.batch_version = -1
        self.publishing = False
        self.burst_ending = False
        self.supply_since: float | None = None
        self.now = 0.0
        self.staleness: list[int] = []  # per consumed group, in consumption order
        self.staleness_refill: list[bool] = []
        self.claims_while_running = 0  # micro-steps claimed while an execution ran on an elastic cell
        self.started = False
        self.health = CellHealth(params.K)  # the caller sets its restarts and rejoin rule before start
        self.rollout_only: set[int] = set()  # restored satellites that serve but may not train (CellRestored)
        self._trainable_pending: set[int] = set()  # rollout-only, may train once no later cell trains
        self._carried_dispatches: list[
            Decision
        ] = []  # a resumed run's open groups' new executions (resume_at)

    # ---- public -----------------------------------------------------------------------------------------------
    def resume_at(self, version: int, next_group: int, carried: Sequence[CarriedGroup] = ()) -> None:
        """Before ``start``, for a resumed run (``gyre run --resume``): ``version`` optimizer steps are done and
        published (the trainer's checkpoint), and new groups are numbered from ``next_group`` on, so no group or
        execution id of the interrupted run is reused. ``carried``: the interrupted run's untrained groups with
        finished members (``Ledger.carry``): the ready ones are held READY (oldest version first into batches, as
        any ready group), and the caller sends them to the trainer; the open ones get the executions they lack,
        dispatched first by ``start``, which then dispatches as at the start of a run."""
        if self.started:
            raise InvariantError("resume_at after start()")
        self.version = self.ledger.published = version
        self.ledger.number_groups_from(next_group)
        for group in carried:
            if (more := self.ledger.carry(group)) is not None:
                self._carried_dispatches.append(more)

    def start(self, now: float = 0.0) -> list[Decision]:
        """Initial dispatch d(0) = (phi + mu) * N_d * B (or Q_c groups), then launches."""
        if self.started:
            raise InvariantError("policy started twice")
        self.started, self.now = True, now
        p = self.params
        out: list[Decision] = self._carried_dispatches
        if p.dispatch == "continuous":
            groups = p.q_c or p.phi_B + p.mu * p.B
            out += [self.ledger.dispatch() for _ in range(groups)]
        else:
            out += self._dispatch_burst(self.planner.first(self))
        out += self._initial_roles()
        self._roles_changed()
        self._progress(out)
        return out

    def handle(self, event: Event, now: float) -> list[Decision]:
        if not self.started:
            raise InvariantError("event before start()")
        if now < self.now - 1e-9:
            raise InvariantError(f"time went backwards: {now} < {self.now}")
        self.now = now
        out: list[Decision] = []
        match event:
            case Launched(eid):
                if self.ledger._exec(eid).state is ExecState.QUEUED:
                    raise InvariantError(f"runner reports launch of {eid}, which the policy never launched")
            case Terminated(eid, outcome):
                e = self.ledger._exec(eid)
                engine = e.engine
                out += self.ledger.terminated(eid, outcome)
                if self.predictor is not None:
                    self.predictor.terminated(eid, outcome, now)
                if engine is not None:
                    self.load[engine].discard(eid)
            case Assessed(eid, status):
                out.append(AssessmentRecorded(eid, status))
                out += self.ledger.assessed(eid, status)
            case GroupAssigned(gid):
                self._assign(gid)
            case TransitionDone(cell) | MicrostepClaimed(cell, _) if cell in self.lost:
                # reported just before the cell died, and heard after its loss (the core reports claims, the loss
                # comes from the cell's own stream): its claims are requeued by the trainer
                pass
            case MicrostepClaimed(cell, gid):
                self._claim(cell, gid)
            case StepDone(version):
                out += self._step_done(version)
            case CellLost(cell):
                out += self._cell_lost(cell)
            case CellRestarted(cell):
                out += self.health.restarted(
                    cell, publishing=self.publishing, published=self.ledger.published
                )
            case CellRestartFailed(cell, reason):
                out += self.health.restart_failed(cell, reason)
            case WeightsLoaded(cell, version):
                facts = self.health.weights_loaded(
                    cell, version, publishing=self.publishing, published=self.ledger.published
                )
                out += self._health_facts(facts)
            case WeightsLoadFailed(cell, version, reason):
                out += self.health.load_failed(
                    cell, version, reason, publishing=self.publishing, published=self.ledger.published
                )
            case CollectiveFailed(_version, cells):
                self.health.collective_failed(cells)
            case EnginesLoaded(version):
                if not self.publishing or version != self.version:
                    raise InvariantError(f"engines loaded {version} with publishing={self.publishing}")
                trains_through = any(self._stays_in_training(i) for i in range(1, self.params.K))
                out += self._health_facts(
                    self.health.boundary(version, self.roles, trains_through=trains_through)
                )
            case WorldFormed(generation):
                out += self._health_facts(self.health.world_formed(generation))
            case WorldFailed(generation, _reason):
                out += self._health_facts(self.health.world_failed(generation))
            case SatelliteBurstEnded(cell):
                # Heard before the core's step end (a join then waits harmlessly: a switch to rollout makes it
                # leave) or after it (a cell that stays in training joins the next burst).
                stays = not self.burst_ending or self._stays_in_training(cell)
                if self.roles[cell] is CellRole.TRAINING and stays:
                    out.append(Join(cell))
            case TransitionDone(cell):
                out += self._transition_done(cell)
            case PublishDone(version):
                out += self._publish_done(version)
            case Tick():
                pass
            case _:
                raise InvariantError(f"unknown event {event!r}")
        self._progress(out)
        # A cell sent back out of training in the same event joins nothing.
        return [d for d in out if not (isinstance(d, Join) and self.roles[d.cell] is not CellRole.TRAINING)]

    def next_wakeup(self) -> float | None:
        """When the supply-check timer expires (the caller sends Tick then), or None."""
        if self.supply_since is None:
            return None
        t = self.supply_since + self.params.tau_s
        return t if t > self.now else None

    # ---- capacity, launches, routes -----------------------------------------------------------------------------
    @property
    def k(self) -> int:
        """Cells not in ROLLOUT (training or switching either way)."""
        return self._k

    def _roles_changed(self) -> None:
        self._k = sum(r not in (CellRole.ROLLOUT, CellRole.LOST) for r in self.roles)
        self._dest = self._destinations()

    @property
    def lost(self) -> set[int]:
        """Satellites that serve nothing (lost, restarting, or gone): ``health``'s view."""
        return self.health.down

    @property
    def live_cells(self) -> int:
        """K less the lost cells."""
        return self.params.K - len(self.lost)

    def capacity(self) -> int:
        """Equation 3: C(t) = (K - k(t)) * C_e + C_s, K counting live cells only."""
        return (self.live_cells - self.k) * self.params.C_e + self.params.C_s

    def engines_ready(self) -> bool:
        """Engines serve the latest published version except while a publication is in flight."""
        return not self.publishing

    def _destinations(self) -> list[str]:
        """Standalone engines first, then rollout cells in descending index (they stay available longest)."""
        order = [STANDALONE] if self.params.C_s else []
        order += [cell_engine(i) for i in reversed(range(self.params.K)) if self.roles[i] is CellRole.ROLLOUT]
        return order

    def _engine_capacity(self, engine: str) -> int:
        return self.params.C_s if engine == STANDALONE else self.params.C_e

    def _free_engine(self) -> str | None:
        for eng in self._dest:
            if len(self.load[eng]) < self._engine_capacity(eng):
                return eng
        return None

    def _launch(self, out: list[Decision]) -> None:
        """Equation 4: launch max(0, min(d - p - x, C(t) - (p - f))) queued entries."""
        if not self.engines_ready():
            return
        led, p = self.ledger, self.params
        n = max(0, min(led.queued, self.capacity() - led.running))
        for _ in range(n):
            e = led.pop_queued()
            engine = self._free_engine()
            if e is None or engine is None:
                raise InvariantError("eq. 4 promised a slot but no queued entry or engine slot exists")
            led.mark_launched(e, engine)
            self.load[engine].add(e.id)
            g = led.groups[e.group]
            spec = ExecutionSpec(
                execution_id=e.id,
                group_id=g.id,
                query_id=g.query,
                dispatch_version=g.v_d,
                dispatch_index=e.index,
                harness_timeout_s=p.harness_timeout_s,
                overall_budget_s=p.overall_budget_s,
                engine=engine,
            )
            out.append(Launch(spec))
            if self.predictor is not None:
                self.predictor.launched(e.id, g.query, self.now)

    def _begin(self, cells: list[int], out: list[Decision]) -> None:
        """Start role changes; cells leaving rollout stop accepting requests and their executions are rerouted."""
        moving: list[str] = []
        for cell in cells:
            src = self.roles[cell]
            self.roles[cell] = next_role(src)
            self._roles_changed()
            out.append(BeginTransition(cell, src, self.roles[cell]))
            if src is CellRole.ROLLOUT:
                moving += sorted(self.load[cell_engine(cell)])
                self.load[cell_engine(cell)].clear()
        for eid in moving:  # destinations are reserved only after every leaving cell is out of the order
            engine = self._free_engine()
            if engine is None:
                raise InvariantError(f"no destination capacity to reroute {eid}")
            self.load[engine].add(eid)
            self.ledger.execs[eid].engine = engine
            out.append(Reroute(eid, engine))

    def _cell_lost(self, cell: int) -> list[Decision]:
        """A satellite died: out of every role decision; its executions move to free slots, else are cancelled.

        A transition it was in is over (nobody waits for its TransitionDone); micro-steps it claimed are requeued by
        the trainer's coordinator, which also takes it out of the batch's collectives.
        """
        if cell == 0:
            raise InvariantError("the core cell cannot be lost (it holds the optimizer): the run must stop")
        if cell in self.lost:
            return []
        out: list[Decision] = self.health.lost(cell)
        self.rollout_only.discard(cell)
        self.roles[cell] = CellRole.LOST
        self._roles_changed()
        engine = cell_engine(cell)
        for eid in sorted(self.load[engine]):
            dest = self._free_engine()
            if dest is None:  # stays counted on the lost engine until the runner reports it cancelled
                if (cancel := self.ledger.cancel(eid, "cell_lost")) is not None:
                    out.append(cancel)
                continue
            self.load[engine].discard(eid)
            self.load[dest].add(eid)
            self.ledger.execs[eid].engine = dest
            out.append(Reroute(eid, dest))
        self._maybe_publish(out)  # a burst end may have waited for this cell's transition
        return out

    def _health_facts(self, decisions: list[Decision]) -> list[Decision]:
        """What the cell-health machine found, applied to roles: a restored cell serves again, an untrained one is
        rollout-only."""
        out: list[Decision] = []
        for d in decisions:
            out.append(d)
            match d:
                case CellRestored(cell, trains, _):
                    self._cell_restored(cell, trains)
                case CellUntrained(cell):
                    out += self._cell_untrained(cell)
                case _:
                    pass
        return out

    def _cell_restored(self, cell: int, trains: bool) -> None:
        """A restarted satellite serves the published version: back in rollout (launches fill it), rollout-only.

        ``trains``: its training side rejoined the world; a rollout-only cell becomes trainable as soon as no later
        cell trains (the training set stays a prefix)."""
        if trains:
            if cell not in self.rollout_only:
                raise InvariantError(f"cell {cell} rejoined training, but it is not rollout-only")
            self._trainable_pending.add(cell)
            return
        if self.roles[cell] is not CellRole.LOST:
            raise InvariantError(f"cell {cell} restored, but it is {self.roles[cell].value}")
        self.rollout_only.add(cell)
        self.roles[cell] = CellRole.ROLLOUT
        self._roles_changed()
        self._reset_supply()

    def _cell_untrained(self, cell: int) -> list[Decision]:
        """A live satellite's training world is gone (a failed re-form, at a burst boundary): rollout-only."""
        if cell == 0 or cell in self.lost:
            # health never says so
            raise InvariantError(f"cell {cell} cannot become rollout-only (core or lost)")
        if self.roles[cell] is not CellRole.ROLLOUT:
            raise InvariantError(f"cell {cell} lost its training world while {self.roles[cell].value}")
        self.rollout_only.add(cell)
        self._trainable_pending.discard(cell)
        return []

    def _admit_trainable(self) -> None:
        for cell in sorted(self._trainable_pending):
            if cell in self.lost or cell not in self.rollout_only:
                self._trainable_pending.discard(cell)
            elif all(
                self.roles[i] in (CellRole.ROLLOUT, CellRole.LOST) for i in range(cell + 1, len(self.roles))
            ):
                self._trainable_pending.discard(cell)
                self.rollout_only.discard(cell)
                self._roles_changed()  # a policy may route by trainability (Async's returning cells)

    def trainable(self) -> list[int]:
        """Cells that may train: neither lost nor restored rollout-only."""
        return [i for i in range(self.params.K) if i not in self.lost and i not in self.rollout_only]

    def _live_prefix(self, cells: list[int]) -> bool:
        """``cells`` are the first trainable cells (the training set is a prefix, up to lost/rollout-only cells)."""
        return cells == self.trainable()[: len(cells)]

    # ---- batches, steps, bursts ---------------------------------------------------------------------------------
    def _open_batch(self, out: list[Decision]) -> None:
        self.batch, self.batch_version = [], self.version
        out.append(OpenBatch(self.version))
        self._reset_supply()

    def _assign(self, gid: str) -> None:
        if self.batch is None:
            raise InvariantError(f"group {gid} assigned with no batch open")
        if len(self.batch) >= self.params.B:
            raise InvariantError(f"batch {self.batch_version} already holds B groups")
        self.batch.append(self.ledger.assign(gid))

    def _claim(self, cell: int, gid: str) -> None:
        if self.roles[cell] is not CellRole.TRAINING:
            raise InvariantError(f"cell {cell} claimed a micro-step while {self.roles[cell].value}")
        if self.batch is None or all(g.id != gid for g in self.batch):
            raise InvariantError(f"micro-step of {gid}, which is not in the open batch")
        if any(self.load[e] for e in self._cell_engines):
            self.claims_while_running += 1

    def _step_done(self, version: int) -> list[Decision]:
        if self.batch is None or version != self.version + 1 or len(self.batch) != self.params.B:
            raise InvariantError(
                f"step {version} done, but open batch is {self.batch_version} with "
                f"{0 if self.batch is None else len(self.batch)} groups"
            )
        if self.roles[0] is not CellRole.TRAINING:
            # the core takes every optimizer step: a step reported while it is away from training is a broken
            # report, and accepting it led later to a begin of the core mid-switch (found by test_invariants)
            raise InvariantError(f"step {version} done while the core is {self.roles[0].value}")
        st = [self.version - g.v_d for g in self.batch]
        for g in self.batch:
            self.ledger.consume(g)
            self.staleness_refill.append(g.refill)
        self.staleness += st
        out: list[Decision] = [StepRecorded(version, tuple(g.id for g in self.batch), tuple(st))]
        self.version, self.batch = version, None
        self.step_in_burst += 1
        if self.step_in_burst < self.mu_now:
            self._open_batch(out)
        else:
            self._burst_end(out)
        return out

    def _burst_end(self, out: list[Decision]) -> None:
        """All training satellites return; publication starts once none is away from rollout."""
        self.burst_ending = True
        for i in range(1, self.params.K):
            if self.roles[i] is CellRole.TRAINING and not self._stays_in_training(i):
                self._begin([i], out)
        self._maybe_publish(out)

    def _maybe_publish(self, out: list[Decision]) -> None:
        if not self.burst_ending or self.publishing:
            return
        if any(self.roles[i] in (CellRole.TO_TRAINING, CellRole.TO_ROLLOUT) for i in range(1, self.params.K)):
            return
        self.publishing = True
        out.append(Publish(self.version))

    def _publish_done(self, version: int) -> list[Decision]:
        if not self.publishing or version != self.version:
            raise InvariantError(
                f"publish of {version} done, but publishing={self.publishing} v={self.version}"
            )
        self.publishing = self.burst_ending = False
        self.ledger.published = version
        self.step_in_burst = 0
        p, out = self.params, self.health.publish_done(version)
        plan = self.planner.next(self) if p.dispatch == "boundary" else None
        pending = plan.dispatch * (p.N + plan.k_spare) if plan else 0
        stay = self._core_persists(pending)  # eq. 6 is evaluated before the new dispatch lands
        if plan:
            out += self._dispatch_burst(plan)
        if stay:
            self._open_batch(out)
        else:
            self._begin([0], out)
        return out

    def _dispatch_burst(self, plan: BurstPlan) -> list[Decision]:
        """The burst's dispatch: ``plan.dispatch`` groups of N + plan.k_spare executions."""
        self.mu_now, self.k_now = plan.mu, plan.k_spare
        self.ledger.N_d = self.params.N + plan.k_spare  # refills of this burst get the same spares
        out: list[Decision] = []
        # a fixed plan is the header's (phi, mu, k_spare): traces stay as they were
        if self.params.planner != "fixed":
            out.append(BurstPlanned(self.version, plan.mu, plan.dispatch, plan.k_spare))
        return out + [self.ledger.dispatch() for _ in range(plan.dispatch)]

    def _transition_done(self, cell: int) -> list[Decision]:
        src = self.roles[cell]
        if src not in (CellRole.TO_TRAINING, CellRole.TO_ROLLOUT):
            raise InvariantError(f"transition of cell {cell} done while {src.value}")
        dst = next_role(src)
        self.roles[cell] = dst
        self._roles_changed()
        out: list[Decision] = [EndTransition(cell, src, dst)]
        self._reset_supply()
        if dst is CellRole.TRAINING:
            if cell != 0 and self.burst_ending and not self._stays_in_training(cell):
                self._begin([cell], out)  # too late for this burst: straight back
            else:
                self._on_training(cell, out)
                if cell:
                    out.append(Join(cell))  # its claims find it in training
        self._maybe_publish(out)
        return out

    # ---- supply check -------------------------------------------------------------------------------------------
    def supply(self) -> int:
        """min(ready unassigned groups, groups the current batch still needs)."""
        p = self.params
        need = p.B - len(self.batch) if (self.batch is not None and p.streaming) else p.B
        return min(len(self.ledger.ready), need)

    def _supply_ok(self) -> bool:
        return self.supply() >= self.params.rho_min * self.params.B - 1e-9

    def _reset_supply(self) -> None:
        self.supply_since = self.now if self._supply_ok() else None

    def _track_supply(self) -> None:
        if not self._supply_ok():
            self.supply_since = None
        elif self.supply_since is None:
            self.supply_since = self.now

    def _supply_held(self) -> bool:
        return self.supply_since is not None and self.now - self.supply_since >= self.params.tau_s - 1e-9

    def effective_waterlevel(self) -> int:
        """w(t) plus pending refills counted as N_d executions each (eq. 5 and 6)."""
        return self.ledger.waterlevel + self.ledger.pending_refill_extra()

    # ---- the loop and invariants --------------------------------------------------------------------------------
    def _progress(self, out: list[Decision]) -> None:
        if self._trainable_pending:
            self._admit_trainable()
        for _ in range(self.params.K + 2):  # a transition can enable a launch and vice versa; bounded
            before = len(out)
            self._launch(out)
            self._track_supply()
            self._maybe_transition(out)
            if len(out) == before:
                break
        self.check_invariants()

    def check_invariants(self) -> None:
        led, p = self.ledger, self.params
        led.check(deep=self.deep_checks)
        on_lost = sum(len(self.load[self._cell_engines[i]]) for i in self.lost)  # being cancelled
        if led.running - on_lost > self.capacity():
            raise InvariantError(f"running {led.running} exceeds rollout capacity {self.capacity()}")
        for i, r in enumerate(self.roles):
            ids = self.load[self._cell_engines[i]]
            if len(ids) > p.C_e or (ids and r not in (CellRole.ROLLOUT, CellRole.LOST)):
                raise InvariantError(f"cell {i} ({r.value}) holds {len(ids)} executions")
        if p.C_s and len(self.load[STANDALONE]) > p.C_s:
            raise InvariantError(f"standalone pool holds {len(self.load[STANDALONE])} executions")
        training = [i for i, r in enumerate(self.roles) if r is CellRole.TRAINING]
        if not self._live_prefix(training) and not self._pool_switching():
            raise InvariantError(f"training set {training} is not a prefix")
        if not self.burst_ending:
            joining = [i for i, r in enumerate(self.roles) if r in (CellRole.TRAINING, CellRole.TO_TRAINING)]
            if not self._live_prefix(joining):
                raise InvariantError(f"training-bound cells {joining} are not a prefix")
        if self.deep_checks and sum(len(v) for v in self.load.values()) != led.running:
            raise InvariantError("engine loads disagree with running count")

    # ---- policy-specific hooks ----------------------------------------------------------------------------------
    def _initial_roles(self) -> list[Decision]:
        return []

    def _maybe_transition(self, out: list[Decision]) -> None:
        raise NotImplementedError

    def _on_training(self, cell: int, out: list[Decision]) -> None:
        if cell == 0 and self.batch is None:
            self._open_batch(out)

    def _stays_in_training(self, cell: int) -> bool:
        return False

    def _pool_switching(self) -> bool:
        """True while a whole pool switches as one unit (its cells finish in any order)."""
        return False

    def _core_persists(self, pending: int) -> bool:
        return False
