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
    """A satellite cell's worker died. Its executions are rerouted (or cancelled when no engine is free), its claimed
    micro-steps are requeued by the trainer's coordinator, and it is out of every later role decision."""

    cell: int


@dataclass(frozen=True, slots=True)
class CellRestored:
    """A lost satellite's worker was restarted and serves the current policy version: it takes rollout work again.

    ``trains``: it may also train (its training side rejoined the gloo world). While False the cell is rollout-only:
    no role decision sends it to training (the training set stays a prefix of the cells that can train). Sent again
    with ``trains=True`` for a cell restored rollout-only, it makes that cell trainable."""

    cell: int
    trains: bool = False
    version: int | None = None
    """The published policy version its engine serves (traced; the policy does not use it)."""


@dataclass(frozen=True, slots=True)
class CellUntrained:
    """A live satellite, in rollout, lost its training side's world (a re-form of the gloo world failed because
    another cell never arrived): it stays in rollout and is rollout-only, like a restored cell, until
    ``CellRestored(cell, trains=True)`` after the next re-form."""

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
    | CellRestored
    | CellUntrained
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
