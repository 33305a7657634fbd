"""Cell faults in the simulator: the scenarios the real-process fault tests play, on a simulated clock.

A ``FaultPlan`` names what goes wrong (a satellite killed at a time or at its n-th claim, stopped when a publication
starts, hung inside a batch's end-of-batch reduce, dying inside a re-form of the training world) and what the parts
that recover cost (restart, weight load, re-form). ``Simulator(cfg, faults=plan)`` then plays the controller's effect
handlers and the launcher: it reports ``CellLost`` once the loss is found (at once for a kill, whose event stream
ends; after the silence bound for a stopped cell), carries out the cell-health machine's ``RestartCell``,
``LoadWeights`` and ``ReformWorld`` (``gyre_sched.health``), fails a load whose publication moved on (the core
refreshes its buffer in place), and requeues the micro-step a dead cell was running, as gyre-train's coordinator does.
The run is deterministic: the same plan gives the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gyre_sched.events import (
    CellLost,
    CellRestarted,
    CellRestartFailed,
    CellRestored,
    CollectiveFailed,
    Decision,
    LoadWeights,
    Publish,
    ReformWorld,
    RestartCell,
    WeightsLoaded,
    WeightsLoadFailed,
    WorldFailed,
    WorldFormed,
)

__all__ = ["Fault", "FaultPlan", "FaultPlaying"]

FaultKind = Literal["kill", "stop", "hang_in_reduce", "die_in_reform"]


@dataclass(frozen=True)
class Fault:
    """``kill``: SIGKILL at ``at_s`` or right after the cell's ``at_claim``-th micro-step claim (found at once);
    ``stop``: SIGSTOP at ``at_s`` or when the publication of version ``at_publish`` starts (found after the silence
    bound); ``hang_in_reduce``: the cell hangs in batch ``batch``'s end-of-batch reduce (the core recomputes its
    micro-steps after the collective timeout, the cell lives on); ``die_in_reform``: the cell dies inside the re-form
    of world ``generation``."""

    cell: int
    kind: FaultKind
    at_s: float | None = None
    at_claim: int | None = None
    at_publish: int | None = None
    batch: int | None = None
    generation: int | None = None

    def __post_init__(self) -> None:
        if self.cell < 1:
            raise ValueError("only a satellite (cell >= 1) can fail: the core holds the optimizer")
        triggers = {
            "kill": (self.at_s, self.at_claim),
            "stop": (self.at_s, self.at_publish),
            "hang_in_reduce": (self.batch,),
            "die_in_reform": (self.generation,),
        }[self.kind]
        if sum(x is not None for x in triggers) != 1:
            raise ValueError(f"a {self.kind} fault needs exactly one trigger, got {self}")


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)
    restarts: int = 1
    """Restarts of one cell's worker (``[launcher] cell_restarts``); past them it is lost for good."""
    restart_s: float = 30.0
    load_s: float = 3.0
    reform_s: float = 2.0
    silence_s: float = 20.0
    """A stopped cell is found lost this long after it stopped (``[launcher] cell_silence_s``)."""
    collective_timeout_s: float = 30.0
    restarts_fail: tuple[int, ...] = ()
    """Cells whose every restart fails (the worker never gets ready): lost for good at their first loss."""


class FaultPlaying:
    """The simulator's part for faults (mixed into ``Simulator``): the launcher, the controller's cell effects and
    gyre-train's coordinator as far as a dead cell goes."""

    faults: FaultPlan

    def _init_faults(self, plan: FaultPlan | None) -> None:
        self.faults = plan or FaultPlan()
        K = self.params.K
        self.policy.health.restarts = plan is not None  # the launcher says when a cell's restarts are spent
        self._dead: set[int] = set()
        self._epoch = [0] * K  # a cell's life: a report from an earlier one is dropped
        self._doing: dict[int, str] = {}  # cell -> group of the micro-step it runs
        self._claims = [0] * K
        self._restarts_used = [0] * K
        self._buffer_version = self.policy.version  # the core's publication buffer, refreshed when one starts
        for i, f in enumerate(self.faults.faults):
            if f.at_s is not None:
                self._at(f.at_s, ("fault", i))

    def _kill(self, cell: int, found_after: float | None) -> None:
        """The cell's worker dies (or stops): its micro-step in flight is requeued; the loss is found after
        ``found_after`` (None: the caller reports it)."""
        if cell in self._dead or cell in self.policy.lost:
            return
        self._dead.add(cell)
        self._epoch[cell] += 1
        self._busy.discard(cell)
        self._warm.discard(cell)  # a new worker warms up again
        gid, b = self._doing.pop(cell, None), self._batch
        if gid is not None and b is not None and not b.finishing:
            b.todo.append(gid)  # claimed, unfinished: the coordinator hands it out again
        if found_after is not None:
            self._at(self.now + found_after, ("lost", cell, self._epoch[cell]))

    def _lost(self, cell: int) -> None:
        self._deliver(CellLost(cell))
        self._role_change(cell)

    def _fault_item(self, item: tuple) -> None:
        kind = item[0]
        if kind == "fault":
            f = self.faults.faults[item[1]]
            self._kill(f.cell, 0.0 if f.kind == "kill" else self.faults.silence_s)
        elif kind == "lost":
            if self._epoch[item[1]] == item[2]:
                self._lost(item[1])
        elif kind == "restarted":
            self._dead.discard(item[1])
            self._epoch[item[1]] += 1
            self._deliver(CellRestarted(item[1]))
        elif kind == "restart_failed":
            self._deliver(CellRestartFailed(item[1], "the restart failed"))
        elif kind == "loaded":
            _, cell, version, epoch = item
            if cell in self._dead or self._epoch[cell] != epoch:
                self._deliver(WeightsLoadFailed(cell, version, "the engine does not answer"))
            elif self._buffer_version != version:
                self._deliver(WeightsLoadFailed(cell, version, f"pulled version {self._buffer_version}"))
            else:
                self._deliver(WeightsLoaded(cell, version))
        elif kind == "reform":
            _, generation, members = item
            dying = [
                f.cell
                for f in self.faults.faults
                if f.kind == "die_in_reform" and f.generation == generation and f.cell in members
            ]
            for cell in dying:
                self._kill(cell, None)
            dead = [m for m in members if m in self._dead]  # a member that never arrives fails the rendezvous
            for cell in dead:
                self._lost(cell)  # found by its failed call (a second report of a known loss changes nothing)
            self._deliver(
                WorldFailed(generation, f"cell(s) {dead} never arrived") if dead else WorldFormed(generation)
            )

    def _fault_decision(self, d: Decision) -> None:
        plan = self.faults
        match d:
            case RestartCell(cell):
                fails = cell in plan.restarts_fail
                if fails or self._restarts_used[cell] >= plan.restarts:
                    self._at(self.now + (plan.restart_s if fails else 0.0), ("restart_failed", cell))
                else:
                    self._restarts_used[cell] += 1
                    self._at(self.now + plan.restart_s, ("restarted", cell))
            case LoadWeights(cell, version, after_s):
                self._at(self.now + after_s + plan.load_s, ("loaded", cell, version, self._epoch[cell]))
            case ReformWorld(generation, _rejoining, members):
                every = tuple(range(self.params.K)) if members is None else members
                self._at(self.now + plan.reform_s, ("reform", generation, every))
            case CellRestored(cell, False, _):
                self._role_change(cell)
            case Publish(version):
                self._buffer_version = version
                for f in plan.faults:
                    if f.kind == "stop" and f.at_publish == version:
                        self._kill(f.cell, plan.silence_s)
            case _:
                pass

    def _claimed(self, cell: int, gid: str) -> bool:
        """After a claim: False if the cell dies right there (its micro-step is requeued)."""
        self._doing[cell] = gid
        self._claims[cell] += 1
        for f in self.faults.faults:
            if f.kind == "kill" and f.cell == cell and f.at_claim == self._claims[cell]:
                self._kill(cell, 0.0)
                return False
        return True

    def _reduce_hangs(self, version: int, participants: set[int]) -> float:
        """At the end of batch ``version``: a hung satellite fails the collective; the extra time it costs."""
        hung = tuple(
            sorted(
                f.cell
                for f in self.faults.faults
                if f.kind == "hang_in_reduce"
                and f.batch == version
                and f.cell in participants
                and f.cell not in self._dead
            )
        )
        if not hung:
            return 0.0
        if self.trace:  # as the controller traces the core's report
            self.trace.write(self.now, "collective_failed", version=version, cells=list(hung))
        self._deliver(CollectiveFailed(version, hung))
        return self.faults.collective_timeout_s
