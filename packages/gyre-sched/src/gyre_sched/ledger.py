"""Dispatch accounting: counters d, p, f, x, the queue (entries record v_d), group completion, drops and refills.

Counters are cumulative executions: d dispatched, p launched, f terminated, x withdrawn (queued entries removed before
launch). Invariant: 0 <= f <= p <= d - x. A group is ready when the first N non-excluded executions in dispatch-index
order all have valid rewards (spares replace excluded executions in that order, never by completion order); it is
dropped when it can no longer reach N valid rewards; a dropped group is refilled at once at the current published
version, with launch priority. An execution that ends without a score (timeout, stall, or cancelled while its group
is open) is excluded.

Spares (dispatch index >= N) launch with the group (``spares = "eager"``) or only on capacity nothing else wants
(``"idle"``): they queue behind every other entry, and one moves to the front of the queue (refill priority) the moment
an exclusion makes it one of the group's first N non-excluded executions. Which executions count never depends on
launch or completion order, only on dispatch index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gyre_sched.errors import InvariantError
from gyre_sched.events import Cancel, Decision, Dispatch, GroupDropped, GroupReady, Withdraw
from gyre_sched.types import AssessedStatus, Outcome


class ExecState(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    TERMINATED = "terminated"
    WITHDRAWN = "withdrawn"


def settle_group(statuses: Sequence[AssessedStatus | None], N: int) -> tuple[str, list[int]]:
    """The one readiness rule (the ledger's and gyre-eval's ``group_status``): ``statuses`` per dispatch index
    (None: no designated result yet). Returns ``("dropped", [])`` when more executions are excluded than there are
    spares, else the first N non-excluded indices with ``"ready"`` when all of them are valid or no_work, ``"pending"``
    otherwise: a later execution never takes the place of an earlier one still running."""
    excluded = sum(s == "excluded" for s in statuses)
    if excluded > len(statuses) - N:
        return "dropped", []
    needed = [i for i, s in enumerate(statuses) if s != "excluded"][:N]
    ready = all(statuses[i] in ("valid", "no_work") for i in needed)
    return ("ready" if ready else "pending"), needed


class GroupState(Enum):
    OPEN = "open"  # rollout or evaluation still in progress
    READY = "ready"  # N valid rewards, not yet in a batch
    ASSIGNED = "assigned"  # in the open batch
    CONSUMED = "consumed"  # trained on
    DROPPED = "dropped"


@dataclass(slots=True)
class Execution:
    id: str
    group: str
    index: int
    state: ExecState = ExecState.QUEUED
    outcome: Outcome | None = None
    status: AssessedStatus | None = None
    engine: str | None = None


@dataclass(frozen=True, slots=True)
class CarriedGroup:
    """A group a resumed run takes over from the interrupted one (``gyre run --resume``): no step up to the
    checkpoint trained it, and at least one of its executions finished with a usable score. If its first N
    non-excluded members are all settled it is ready; otherwise it is still open, and the resumed run dispatches the
    executions it lacks into it (see ``Ledger.carry``)."""

    group: str
    query: str
    v_d: int
    members: tuple[tuple[str, AssessedStatus], ...]
    """Every execution the interrupted run dispatched into it, in dispatch-index order (its ids e0, e1, ...), each
    with its status as the resumed run takes it: valid or no_work (assessed, usable), or excluded (never usable:
    excluded, cancelled, withdrawn, or a part of it is missing). New executions are numbered after them."""


@dataclass(slots=True)
class Group:
    id: str
    query: str
    v_d: int
    seq: int
    refill: bool
    n_d: int = 0  # executions dispatched (N + its spares)
    execs: list[str] = field(default_factory=list)
    state: GroupState = GroupState.OPEN
    outstanding: int = 0  # executions queued or running
    ready_seq: int = -1
    carried: bool = (
        False  # taken over open by a resumed run: its new executions launch ahead, like a refill's
    )


class Ledger:
    """Groups, executions, counters and the queue. Knows nothing about cells or capacity."""

    def __init__(self, *, N: int, N_d: int, continuous: bool = False, idle_spares: bool = False) -> None:
        self.N, self.N_d, self.continuous, self.idle_spares = N, N_d, continuous, idle_spares
        self.d = self.p = self.f = self.x = 0
        self.published = 0  # latest published policy version (v_d of new dispatches)
        self.groups: dict[str, Group] = {}
        self.execs: dict[str, Execution] = {}
        self._queue: deque[str] = deque()
        self._spares: deque[str] = deque()  # idle spares: launched only when nothing else is queued
        self._promoted: set[str] = set()  # idle spares moved to the front of the queue
        self._cancelling: set[str] = set()  # running executions with a Cancel out: never cancelled twice
        self._group_seq = 0
        self._ready_seq = 0
        self.ready: dict[str, Group] = {}  # READY groups (unassigned)
        self._open_refills: set[str] = set()  # refill groups still OPEN
        self.unsettled = 0  # groups OPEN
        self.dropped = 0
        self.carried = (
            0  # executions of carried groups: terminated here, counted by the interrupted part's d..x
        )
        self.cancelled_surplus = 0
        self.withdrawn_surplus = 0
        self.launch_key: Callable[[Execution], Any] | None = None
        """None (the default): launches follow the queue. Set: the queue is re-sorted by this key (smallest first,
        stable) before the first launch after a dispatch (``gyre_sched.bound``'s clairvoyant reference: longest
        planned duration first; ``gyre_sched.launch_order``: longest predicted first)."""
        self._unsorted = False
        self.query_of: Callable[[int], str] | None = None
        """The query group number ``seq`` runs (a dataset's queries recur across epochs); default ``q<seq>``."""

    # ---- counters ---------------------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return self.d - self.p - self.x

    @property
    def running(self) -> int:
        return self.p - self.f

    @property
    def waterlevel(self) -> int:
        """w = d - x - f: outstanding executions, queued plus running."""
        return self.d - self.x - self.f

    def pending_refill_extra(self) -> int:
        """Executions of unfinished refill groups that already left w (eq. 5/6 count a pending refill as N_d)."""
        return sum(self.groups[gid].n_d - self.groups[gid].outstanding for gid in self._open_refills)

    # ---- dispatch and launch ----------------------------------------------------------------------------------
    def number_groups_from(self, seq: int) -> None:
        """The next group is g<seq> (a resumed run continues the numbering of the interrupted one)."""
        if seq < self._group_seq:
            raise InvariantError(f"group numbering cannot go back from {self._group_seq} to {seq}")
        self._group_seq = seq

    def carry(self, carried: CarriedGroup) -> Dispatch | None:
        """Take over a resumed run's carried group (before any dispatch of the resumed part) as the interrupted run
        left it. Its executions are terminated and settled here; the counters d, p, f, x do not count them again
        (the interrupted part's trace did). Ready when its first N non-excluded members are settled: held READY.
        Otherwise it stays OPEN and gets the executions it lacks, plus this ledger's spares, numbered after the
        interrupted run's (returned as a ``Dispatch`` of the group, with launch priority). Its v_d stays the
        interrupted run's: the group's staleness is that of its oldest members."""
        gid, members = carried.group, carried.members
        seq = int(gid.removeprefix("g"))
        if gid in self.groups or seq >= self._group_seq:
            raise InvariantError(
                f"carried group {gid} is known or not numbered before the resumed run's groups"
            )
        usable = [eid for eid, status in members if status != "excluded"]
        if not usable or not all(status in ("valid", "no_work", "excluded") for _, status in members):
            raise InvariantError(f"carried group {gid} needs a valid or no_work member: {members}")
        g = Group(gid, carried.query, carried.v_d, seq, False, len(members))
        for index, (eid, status) in enumerate(members):
            self.execs[eid] = Execution(eid, gid, index, ExecState.TERMINATED, "completed", status)
            g.execs.append(eid)
        self.groups[gid] = g
        self.carried += len(members)
        if len(usable) >= self.N:
            g.state = GroupState.READY
            g.ready_seq = self._ready_seq
            self._ready_seq += 1
            self.ready[gid] = g
            return None
        g.carried = True
        self.unsettled += 1
        needed, spares = self.N - len(usable), self.N_d - self.N
        ids = tuple(f"{gid}.e{len(members) + i}" for i in range(needed + spares))
        for i, eid in enumerate(ids):
            self.execs[eid] = Execution(eid, gid, len(members) + i)
            g.execs.append(eid)
        g.n_d = len(members) + len(ids)  # the drop rule's slack is the new spares, as for a new group
        g.outstanding = len(ids)
        self.d += len(ids)
        first = ids[:needed] if self.idle_spares else ids
        self._queue.extendleft(reversed(first))
        if self.idle_spares:
            self._spares.extend(ids[needed:])
        self._unsorted = self.launch_key is not None
        return Dispatch(gid, carried.query, ids, g.v_d, carried=True)

    def dispatch(self, *, refill: bool = False, k_spare: int | None = None) -> Dispatch:
        """A new group of N + k_spare executions (default: the ledger's N_d) at the latest published version."""
        n_d = self.N_d if k_spare is None else self.N + k_spare
        seq = self._group_seq
        self._group_seq += 1
        gid = f"g{seq}"
        qid = self.query_of(seq) if self.query_of is not None else f"q{seq}"
        g = Group(gid, qid, self.published, seq, refill, n_d)
        self.groups[gid] = g
        self.unsettled += 1
        if refill:
            self._open_refills.add(gid)
        ids = tuple(f"{gid}.e{i}" for i in range(n_d))
        for i, eid in enumerate(ids):
            self.execs[eid] = Execution(eid, gid, i)
            g.execs.append(eid)
        g.outstanding = n_d
        self.d += n_d
        first = ids[: self.N] if self.idle_spares else ids
        if refill:  # launch priority: ahead of every ordinary entry, in dispatch-index order
            self._queue.extendleft(reversed(first))
        else:
            self._queue.extend(first)
        if self.idle_spares:
            self._spares.extend(ids[self.N :])
        self._unsorted = self.launch_key is not None
        return Dispatch(gid, qid, ids, g.v_d, refill)

    def prioritized(self, e: Execution) -> bool:
        """Launches ahead of ordinary entries in dispatch order: a refill's execution, or a spare an exclusion made
        count (idle spares)."""
        g = self.groups[e.group]
        return g.refill or g.carried or e.id in self._promoted

    def pop_queued(self) -> Execution | None:
        if self._unsorted and self.launch_key is not None:
            key = self.launch_key
            self._queue = deque(sorted(self._queue, key=lambda eid: key(self.execs[eid])))
            self._unsorted = False
        for q in (self._queue, self._spares):
            while q:
                e = self.execs[q.popleft()]
                if e.state is ExecState.QUEUED:
                    return e
        return None

    def mark_launched(self, e: Execution, engine: str) -> None:
        if e.state is not ExecState.QUEUED:
            raise InvariantError(f"launch of {e.id} in state {e.state.value}")
        e.state, e.engine = ExecState.RUNNING, engine
        self.p += 1

    # ---- termination and assessment ---------------------------------------------------------------------------
    def terminated(self, eid: str, outcome: Outcome) -> list[Decision]:
        e = self._exec(eid)
        if e.state is not ExecState.RUNNING:
            raise InvariantError(
                f"termination of {eid} in state {e.state.value} (each execution terminates once)"
            )
        e.state, e.outcome = ExecState.TERMINATED, outcome
        e.engine = None
        self._cancelling.discard(eid)
        self.f += 1
        g = self.groups[e.group]
        g.outstanding -= 1
        if outcome in ("overall_timeout", "stalled"):  # no valid score can come: excluded, no assessment
            e.status = "excluded"
            return self._settle(g) if g.state is GroupState.OPEN else []
        if outcome == "cancelled" and g.state is GroupState.OPEN:
            # Cancelled while its group still needs it (its cell was lost with no free slot to move it to): it is
            # never assessed, so it is excluded like a timeout and the group settles (a spare takes its place, or
            # the group is dropped and refilled). Left OPEN, the group waited forever and so did the burst.
            e.status = "excluded"
            return self._settle(g)
        return []

    def assessed(self, eid: str, status: AssessedStatus) -> list[Decision]:
        e = self._exec(eid)
        if e.state is not ExecState.TERMINATED or e.outcome == "cancelled":
            raise InvariantError(f"assessment of {eid}, which is {e.outcome or e.state.value}")
        if e.status is not None:
            raise InvariantError(f"second designated assessment of {eid}")
        e.status = status
        g = self.groups[e.group]
        return self._settle(g) if g.state is GroupState.OPEN else []

    def _settle(self, g: Group) -> list[Decision]:
        """Ready when the first N non-excluded executions (index order) are all valid; dropped when impossible."""
        execs = [self.execs[i] for i in g.execs]
        state, indices = settle_group([e.status for e in execs], self.N)
        if state == "dropped":
            return self._drop(g)
        needed = [execs[i] for i in indices]
        if state == "pending":
            # a spare now counts: launch it next
            if self.idle_spares and any(e.status == "excluded" for e in execs):
                for e in needed:
                    if e.index >= self.N and e.state is ExecState.QUEUED and e.id not in self._promoted:
                        self._promoted.add(e.id)
                        self._queue.appendleft(e.id)
            return []
        g.state = GroupState.READY
        self._open_refills.discard(g.id)
        g.ready_seq = self._ready_seq
        self._ready_seq += 1
        self.ready[g.id] = g
        self.unsettled -= 1
        out: list[Decision] = [GroupReady(g.id)]
        keep = {e.id for e in needed}
        for e in execs:  # unneeded spares: cancelled if running (f), withdrawn if queued (x)
            if e.id in keep:
                continue
            if e.state is ExecState.RUNNING:
                if (cancel := self.cancel(e.id, "surplus")) is not None:
                    out.append(cancel)
                    self.cancelled_surplus += 1
            elif e.state is ExecState.QUEUED:
                out.append(self._withdraw(e, g, "surplus"))
                self.withdrawn_surplus += 1
        if self.continuous:  # the group releases its slot once rollout and evaluation finished (appendix Q_c)
            out.append(self.dispatch())
        return out

    def _drop(self, g: Group) -> list[Decision]:
        g.state = GroupState.DROPPED
        self._open_refills.discard(g.id)
        self.unsettled -= 1
        self.dropped += 1
        out: list[Decision] = [GroupDropped(g.id)]
        for eid in g.execs:
            e = self.execs[eid]
            if e.state is ExecState.RUNNING:
                if (cancel := self.cancel(eid, "dropped")) is not None:
                    out.append(cancel)
            elif e.state is ExecState.QUEUED:
                out.append(self._withdraw(e, g, "dropped"))
        out.append(self.dispatch(refill=True))  # refill at once at the current published version
        return out

    def cancel(self, eid: str, reason: str) -> Cancel | None:
        """The Cancel decision for running execution `eid`, or None if one is out already (its termination is
        coming: a second Cancel would end it twice in the simulator, and cancel it twice in the runner)."""
        if eid in self._cancelling:
            return None
        self._cancelling.add(eid)
        return Cancel(eid, reason)

    def _withdraw(self, e: Execution, g: Group, reason: str) -> Withdraw:
        e.state = ExecState.WITHDRAWN
        g.outstanding -= 1
        self.x += 1
        return Withdraw(e.id, reason)

    # ---- training side ----------------------------------------------------------------------------------------
    def ready_unassigned(self) -> list[Group]:
        """Ready groups not in a batch, oldest policy version first (then readiness order)."""
        return sorted(self.ready.values(), key=lambda g: (g.v_d, g.ready_seq))

    def members(self, gid: str) -> list[str]:
        """The N executions whose rewards a ready group counts: the first N non-excluded, in dispatch-index order.

        The one definition of group membership; the trainer and the advantages receive it from here.
        """
        g = self.groups.get(gid)
        if g is None or g.state in (GroupState.OPEN, GroupState.DROPPED):
            raise InvariantError(f"members of {gid}, which is {g.state.value if g else 'unknown'}")
        return [eid for eid in g.execs if self.execs[eid].status != "excluded"][: self.N]

    def assign(self, gid: str) -> Group:
        g = self.groups.get(gid)
        if g is None or g.state is not GroupState.READY:
            raise InvariantError(f"group {gid} assigned while {g.state.value if g else 'unknown'}")
        g.state = GroupState.ASSIGNED
        del self.ready[gid]
        return g

    def consume(self, g: Group) -> None:
        g.state = GroupState.CONSUMED

    def _exec(self, eid: str) -> Execution:
        e = self.execs.get(eid)
        if e is None:
            raise InvariantError(f"unknown execution {eid}")
        return e

    # ---- checks -----------------------------------------------------------------------------------------------
    def check(self, deep: bool = False) -> None:
        if not 0 <= self.f <= self.p <= self.d - self.x:
            raise InvariantError(
                f"counters broke 0 <= f <= p <= d - x: d={self.d} p={self.p} f={self.f} x={self.x}"
            )
        if not deep:
            return
        counts = {s: 0 for s in ExecState}
        for e in self.execs.values():
            counts[e.state] += 1
        if counts[ExecState.QUEUED] != self.queued or counts[ExecState.RUNNING] != self.running:
            raise InvariantError(f"per-execution states disagree with counters: {counts}")
        if counts[ExecState.WITHDRAWN] != self.x or counts[ExecState.TERMINATED] != self.f + self.carried:
            raise InvariantError(f"per-execution states disagree with counters: {counts}")
        for g in self.groups.values():
            live = sum(self.execs[i].state in (ExecState.QUEUED, ExecState.RUNNING) for i in g.execs)
            if live != g.outstanding:
                raise InvariantError(f"group {g.id} outstanding {g.outstanding} != {live}")
