"""Events into the policy core and decisions out of it (in-process; the wire forms live in ``types``).

The policy core is a pure state machine: ``decisions = policy.handle(event, now)``. It does no I/O and never reads a
clock; the caller (the real controller or the simulator) executes the decisions and reports what happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_sched.types import AssessedStatus, CellRole, CellTransition, ExecutionSpec, Outcome, Route

# ---- events in ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Launched:
    """The runner created the harness and sandbox of an execution the policy launched (acknowledgement)."""

    execution_id: str


@dataclass(frozen=True, slots=True)
class Terminated:
    """An execution ended (exactly once)."""

    execution_id: str
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Assessed:
    """The designated assessment of a terminated execution is final: valid, no_work, or excluded."""

    execution_id: str
    status: AssessedStatus


@dataclass(frozen=True, slots=True)
class GroupAssigned:
    """The packing buffer took a ready group into the open batch (streaming: lazily, oldest first)."""

    group_id: str


@dataclass(frozen=True, slots=True)
class MicrostepClaimed:
    """A training cell claimed a micro-step of an assigned group."""

    cell: int
    group_id: str


@dataclass(frozen=True, slots=True)
class StepDone:
    """The core finished the optimizer update; ``version`` is the new policy version."""

    version: int


@dataclass(frozen=True, slots=True)
class TransitionDone:
    """A cell finished its role change (TO_TRAINING -> TRAINING or TO_ROLLOUT -> ROLLOUT)."""

    cell: int


@dataclass(frozen=True, slots=True)
class PublishDone:
    """Every rollout engine now serves ``version``."""

    version: int


@dataclass(frozen=True, slots=True)
class CellLost:
    """A satellite cell's worker died (or hangs: it does not answer its status). Its executions are rerouted (or
    cancelled when no engine is free), its claimed micro-steps are requeued by the trainer's coordinator, it is out of
    every later role decision, and the cell-health machine decides its restart (``RestartCell``)."""

    cell: int


@dataclass(frozen=True, slots=True)
class CellRestarted:
    """The launcher started a lost satellite's worker again and it is ready (rollout side only, no training side)."""

    cell: int


@dataclass(frozen=True, slots=True)
class CellRestartFailed:
    """A lost satellite's restart failed, or its restarts are spent: it is lost for good."""

    cell: int
    reason: str


@dataclass(frozen=True, slots=True)
class WeightsLoaded:
    """A restarted cell's engine loaded published weights and serves ``version`` (its routes are back)."""

    cell: int
    version: int


@dataclass(frozen=True, slots=True)
class WeightsLoadFailed:
    """Loading the published weights into a restarted cell failed (e.g. a publication refreshed the core's buffer
    meanwhile)."""

    cell: int
    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class CollectiveFailed:
    """The end-of-batch reduce or broadcast of batch ``version`` failed with ``cells`` (one died or hangs in it): the
    core ran their micro-steps itself and updated alone. Reported before that batch's ``StepDone``."""

    version: int
    cells: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EnginesLoaded:
    """The publication of ``version`` is in every rollout engine: the burst boundary, where the training world may be
    re-formed before the publication completes (``CompletePublish``)."""

    version: int


@dataclass(frozen=True, slots=True)
class WorldFormed:
    """Every member of ``ReformWorld(generation)`` joined the new gloo world."""

    generation: int


@dataclass(frozen=True, slots=True)
class WorldFailed:
    """The re-form of ``generation`` failed at its bounded rendezvous (the cells found dead in it were reported lost
    first): no satellite has a training world until the next re-form."""

    generation: int
    reason: str


@dataclass(frozen=True, slots=True)
class SatelliteBurstEnded:
    """A training satellite's worker ended its burst (the core's last batch of it); it joins again if it stays."""

    cell: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Clock tick (the supply-check timer may have expired)."""


Event = (
    Launched
    | Terminated
    | Assessed
    | GroupAssigned
    | MicrostepClaimed
    | StepDone
    | TransitionDone
    | PublishDone
    | CellLost
    | CellRestarted
    | CellRestartFailed
    | WeightsLoaded
    | WeightsLoadFailed
    | CollectiveFailed
    | EnginesLoaded
    | WorldFormed
    | WorldFailed
    | SatelliteBurstEnded
    | Tick
)

# ---- decisions out ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A group entered the queue: its executions are queued entries recording v_d (no harness yet)."""

    group_id: str
    query_id: str
    execution_ids: tuple[str, ...]
    v_d: int
    refill: bool = False
    carried: bool = False
    """More executions for a group a resumed run took over open (``Ledger.carry``); its first ones ran before."""


@dataclass(frozen=True, slots=True)
class Launch:
    """Start an execution now (eq. 4), on ``spec.engine``."""

    spec: ExecutionSpec


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a running execution (surplus spare or dropped group); the runner reports Terminated(cancelled)."""

    execution_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Withdraw:
    """A queued entry leaves the queue without launching (counted in x)."""

    execution_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Reroute:
    """Move an execution's model calls to another engine (its source cell is leaving rollout)."""

    execution_id: str
    engine: str


@dataclass(frozen=True, slots=True)
class BeginTransition:
    """A cell starts a role change; the caller reports TransitionDone when it finished."""

    cell: int
    from_role: CellRole
    to_role: CellRole


@dataclass(frozen=True, slots=True)
class EndTransition:
    """Bookkeeping: the policy applied a finished role change (for the trace)."""

    cell: int
    from_role: CellRole
    to_role: CellRole


@dataclass(frozen=True, slots=True)
class Publish:
    """Push ``version`` to every rollout engine; the caller reports PublishDone."""

    version: int


@dataclass(frozen=True, slots=True)
class OpenBatch:
    """Training may start the step that produces ``version + 1``."""

    version: int


@dataclass(frozen=True, slots=True)
class BurstPlanned:
    """Bookkeeping: what the burst starting at ``version`` uses (the planner's choice; fixed: the config)."""

    version: int
    mu: int
    dispatch: int
    k_spare: int


@dataclass(frozen=True, slots=True)
class GroupReady:
    group_id: str


@dataclass(frozen=True, slots=True)
class GroupDropped:
    group_id: str


@dataclass(frozen=True, slots=True)
class AssessmentRecorded:
    """Bookkeeping: an assessment was applied (for the trace)."""

    execution_id: str
    status: AssessedStatus


@dataclass(frozen=True, slots=True)
class StepRecorded:
    """Bookkeeping: a step consumed ``groups`` with these staleness values d = v_t - v_d."""

    version: int
    groups: tuple[str, ...]
    staleness: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Join:
    """A satellite in training joins the open (or next) batch's micro-steps (its worker waits for the batch)."""

    cell: int


@dataclass(frozen=True, slots=True)
class RestartCell:
    """Start a lost satellite's worker again; the caller reports ``CellRestarted`` or ``CellRestartFailed``."""

    cell: int


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """Load the published weights into a restarted cell (after ``after_s``: a back-off); the caller reports
    ``WeightsLoaded`` with the version it serves, or ``WeightsLoadFailed``."""

    cell: int
    version: int
    after_s: float = 0.0


@dataclass(frozen=True, slots=True)
class CellRestored:
    """A lost satellite serves the published version again: back in rollout (its event stream is read again).

    ``trains``: its training side rejoined the world (after ``WorldFormed``). While False it is rollout-only: no role
    decision sends it to training (the training set stays a prefix of the cells that can train)."""

    cell: int
    trains: bool = False
    version: int | None = None
    """The published policy version its engine serves (traced)."""


@dataclass(frozen=True, slots=True)
class CellUntrained:
    """A live satellite has no training world (a re-form failed, or its end-of-batch collective did): it is
    rollout-only until ``CellRestored(cell, trains=True)`` after the next re-form."""

    cell: int


@dataclass(frozen=True, slots=True)
class CellGone:
    """A lost satellite stays lost for good (its restart failed or its restarts are spent): later worlds leave it
    out."""

    cell: int
    reason: str


@dataclass(frozen=True, slots=True)
class ReformWorld:
    """Every member re-forms the gloo world as ``generation`` (``rejoining``: restored cells that take their training
    rank again; ``members``: one rank per remaining cell when a cell is gone, else None: all K). The caller reports
    ``WorldFormed`` or ``WorldFailed`` (and ``CellLost`` first for a member found dead)."""

    generation: int
    rejoining: tuple[int, ...]
    members: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class RejoinRefused:
    """Restored cells serve rollout only: this run's training backend cannot re-form its groups (said once)."""

    cells: tuple[int, ...]
    why: str


@dataclass(frozen=True, slots=True)
class CompletePublish:
    """The boundary's work is done: the caller reports ``PublishDone(version)``."""

    version: int


Decision = (
    Dispatch
    | Launch
    | Cancel
    | Withdraw
    | Reroute
    | BeginTransition
    | EndTransition
    | Publish
    | OpenBatch
    | GroupReady
    | GroupDropped
    | AssessmentRecorded
    | StepRecorded
    | BurstPlanned
    | Join
    | RestartCell
    | LoadWeights
    | CellRestored
    | CellUntrained
    | CellGone
    | ReformWorld
    | RejoinRefused
    | CompletePublish
)


def to_wire(d: Decision) -> ExecutionSpec | Route | CellTransition | None:
    """The wire message a decision becomes for the runner (launch), the proxy (routes) or a cell (role change)."""
    match d:
        case Launch(spec):
            return spec
        case Reroute(eid, engine):
            return Route(execution_id=eid, engine=engine, reason="reroute")
        case BeginTransition(cell, a, b):
            return CellTransition(cell=cell, from_role=a, to_role=b, phase="begin")
        case EndTransition(cell, a, b):
            return CellTransition(cell=cell, from_role=a, to_role=b, phase="end")
        case _:
            return None
