"""Cell health: which satellite cells serve, which are down, which have a training world, and what to do about it.

A pure state machine owned by the policy core (``PolicyCore.health``) and driven by the same ``handle(event, now)``:
no I/O, no clock. The real controller's effect handlers (``gyre.run.cell_effects``) carry out its decisions and report
what happened; the simulator plays those parts on its clock, so every fault scenario runs there too
(``gyre_sched.faults``).

One record per cell and the training world's generation:

- ``SERVING``: alive, with a training side in the current world (the policy may send it to training);
- ``LOST``: its worker died or hangs (``CellLost``); a restart is under way (``RestartCell``);
- ``LOADING``: restarted (``CellRestarted``), loading the published weights (``LoadWeights``); a load meeting a
  publication waits for it, a failed one is tried again (at most ``load_attempts`` in all);
- ``UNTRAINED``: serves rollout (``CellRestored``, or ``CellUntrained`` for a live satellite whose world failed) with no
  training side until the world is re-formed;
- ``GONE``: lost for good (no restarts, its restarts spent, or its restart failed): later worlds leave it out.

A satellite whose end-of-batch collective failed (``CollectiveFailed``) keeps training to the burst's end and becomes
``UNTRAINED`` at the next boundary. The boundary is a publication's ``EnginesLoaded``: with restored cells waiting, no
restart under way, and every satellite in rollout or training, the world is re-formed (``ReformWorld``) as the next
generation with one rank per cell that is not gone; ``WorldFormed`` gives the rejoining cells their training rank
(``CellRestored(trains=True)``), ``WorldFailed`` leaves every live satellite untrained until the next boundary. Either
way, or when nothing is to re-form, ``CompletePublish`` ends the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from gyre_sched.errors import InvariantError
from gyre_sched.events import (
    CellGone,
    CellRestored,
    CellUntrained,
    CompletePublish,
    Decision,
    LoadWeights,
    ReformWorld,
    RejoinRefused,
    RestartCell,
)
from gyre_sched.types import CellRole

__all__ = ["CellHealth", "CellRecord", "Health"]

LOAD_BACKOFF_S = 1.0
"""Wait before loading again after a failed load that no publication explains (times the failures so far)."""


class Health(StrEnum):
    SERVING = "serving"
    LOST = "lost"
    LOADING = "loading"
    UNTRAINED = "untrained"
    GONE = "gone"


DOWN = (Health.LOST, Health.LOADING, Health.GONE)


@dataclass
class CellRecord:
    health: Health = Health.SERVING
    unformed: bool = False
    """Its end-of-batch collective failed: untrained at the next boundary."""
    load_failures: int = 0
    load_waits: bool = False
    """A load waits for the publication under way (loaded once it is done)."""


@dataclass(frozen=True)
class _Reform:
    command: ReformWorld
    version: int


class CellHealth:
    """``restarts``: a lost cell is restarted (else it is gone at once). ``rejoin_refused``: why this run's training
    backend cannot re-form its groups (restored cells then serve rollout only), or None."""

    def __init__(
        self, K: int, *, restarts: bool = False, rejoin_refused: str | None = None, load_attempts: int = 3
    ) -> None:
        self.cells = [CellRecord() for _ in range(K)]
        self.generation = 0  # of the gloo world (0: the one formed at start)
        self.restarts = restarts
        self.rejoin_refused = rejoin_refused
        self.load_attempts = load_attempts
        self._refused_said = False
        self._reform: _Reform | None = None

    # ---- views ------------------------------------------------------------------------------------------------
    def of(self, state: Health) -> set[int]:
        return {i for i, rec in enumerate(self.cells) if rec.health is state}

    @property
    def down(self) -> set[int]:
        """Cells that serve nothing: lost, loading after a restart, or gone."""
        return {i for i, rec in enumerate(self.cells) if rec.health in DOWN}

    def restarting(self) -> set[int]:
        """Cells whose restart is under way (lost, not gone; or loading)."""
        return self.of(Health.LOST) | self.of(Health.LOADING)

    @property
    def reforming(self) -> bool:
        return self._reform is not None

    # ---- loss and restart ---------------------------------------------------------------------------------------
    def lost(self, cell: int) -> list[Decision]:
        rec = self.cells[cell]
        if rec.health in DOWN:
            return []
        rec.unformed, rec.load_failures, rec.load_waits = False, 0, False
        if not self.restarts:
            rec.health = Health.GONE
            return [CellGone(cell, "no restarts in this run")]
        rec.health = Health.LOST
        return [RestartCell(cell)]

    def restarted(self, cell: int, *, publishing: bool, published: int) -> list[Decision]:
        rec = self._expect(cell, Health.LOST, "restarted")
        rec.health = Health.LOADING
        return self._load(cell, publishing=publishing, published=published)

    def restart_failed(self, cell: int, reason: str) -> list[Decision]:
        self._expect(cell, Health.LOST, "failed its restart").health = Health.GONE
        return [CellGone(cell, reason)]

    def _load(self, cell: int, *, publishing: bool, published: int, after_s: float = 0.0) -> list[Decision]:
        # the core refreshes its buffer in place while it publishes: load the new version after
        if publishing:
            self.cells[cell].load_waits = True
            return []
        return [LoadWeights(cell, published, after_s)]

    def weights_loaded(self, cell: int, version: int, *, publishing: bool, published: int) -> list[Decision]:
        """The restarted engine serves ``version``: restored (rollout-only) if that is the published version and no
        publication runs; a publication under way makes it load again after it."""
        if self.cells[cell].health is not Health.LOADING:
            return []  # lost again meanwhile: its new restart loads again
        if publishing:
            return self._load(cell, publishing=True, published=published)
        if version != published:
            return self.load_failed(
                cell,
                version,
                f"serves version {version}, not the published {published}",
                publishing=publishing,
                published=published,
            )
        rec = self.cells[cell]
        rec.health, rec.load_failures = Health.UNTRAINED, 0
        return [CellRestored(cell, trains=False, version=version)]

    def load_failed(
        self, cell: int, version: int, reason: str, *, publishing: bool, published: int
    ) -> list[Decision]:
        rec = self.cells[cell]
        if rec.health is not Health.LOADING:
            return []
        rec.load_failures += 1
        if rec.load_failures >= self.load_attempts:
            rec.health = Health.GONE
            return [
                CellGone(cell, f"loading the published weights failed {rec.load_failures} times: {reason}")
            ]
        # A publication that moved on explains the failure: load its version once it is done. Else back off: the core's
        # buffer can hold the next version before the publication is heard of.
        moved = publishing or published != version
        after = 0.0 if moved else LOAD_BACKOFF_S * rec.load_failures
        return self._load(cell, publishing=publishing, published=published, after_s=after)

    def publish_done(self, published: int) -> list[Decision]:
        """Loads that waited for the publication go now."""
        if self._reform is not None:
            raise InvariantError(f"publication done while world generation {self.generation} re-forms")
        out: list[Decision] = []
        for i, rec in enumerate(self.cells):
            if rec.load_waits:
                rec.load_waits = False
                if rec.health is Health.LOADING:
                    out.append(LoadWeights(i, published))
        return out

    # ---- the training world -------------------------------------------------------------------------------------
    def collective_failed(self, cells: Sequence[int]) -> None:
        for cell in cells:
            if cell and self.cells[cell].health not in DOWN:
                self.cells[cell].unformed = True

    def boundary(self, version: int, roles: Sequence[CellRole], *, trains_through: bool) -> list[Decision]:
        """The publication of ``version`` is in the engines. ``trains_through``: satellites in training stay there
        across the boundary (Async's split), so they re-form from training too."""
        out = self._untrain_unformed(roles, trains_through)
        untrained = sorted(self.of(Health.UNTRAINED))
        if not untrained or self.restarting():  # nothing to do, or a restart is still under way
            return [*out, CompletePublish(version)]
        if self.rejoin_refused is not None:
            if not self._refused_said:
                self._refused_said = True
                out.append(RejoinRefused(tuple(untrained), self.rejoin_refused))
            return [*out, CompletePublish(version)]
        gone = self.of(Health.GONE)
        members = tuple(i for i in range(len(self.cells)) if i not in gone)
        if any(roles[i] not in (CellRole.ROLLOUT, CellRole.TRAINING) for i in members[1:]):
            return [
                *out,
                CompletePublish(version),
            ]  # a satellite still switches: not a boundary for every cell
        self.generation += 1
        command = ReformWorld(self.generation, tuple(untrained), members if gone else None)
        self._reform = _Reform(command, version)
        return [*out, command]

    def _untrain_unformed(self, roles: Sequence[CellRole], trains_through: bool) -> list[Decision]:
        out: list[Decision] = []
        for i, rec in enumerate(self.cells):
            if not rec.unformed:
                continue
            # lost meanwhile (its restart rejoins it), or untrained already
            if rec.health is not Health.SERVING:
                rec.unformed = False
            elif roles[i] is not CellRole.ROLLOUT and not trains_through:
                break  # still switching: the next boundary
            else:
                rec.health, rec.unformed = Health.UNTRAINED, False
                out.append(CellUntrained(i))
        return out

    def world_formed(self, generation: int) -> list[Decision]:
        reform = self._take_reform(generation)
        out: list[Decision] = []
        for cell in reform.command.rejoining:
            if self.cells[cell].health is Health.UNTRAINED:
                self.cells[cell].health = Health.SERVING
                out.append(CellRestored(cell, trains=True, version=reform.version))
        return [*out, CompletePublish(reform.version)]

    def world_failed(self, generation: int) -> list[Decision]:
        """Every live satellite is rollout-only until the next boundary (the cells found dead were reported first)."""
        reform = self._take_reform(generation)
        out: list[Decision] = []
        for i, rec in enumerate(self.cells[1:], start=1):
            if rec.health is Health.SERVING:
                rec.health, rec.unformed = Health.UNTRAINED, False
                out.append(CellUntrained(i))
        return [*out, CompletePublish(reform.version)]

    def _take_reform(self, generation: int) -> _Reform:
        reform = self._reform
        if reform is None or reform.command.generation != generation:
            raise InvariantError(f"world generation {generation} reported, none under way")
        self._reform = None
        return reform

    def _expect(self, cell: int, state: Health, what: str) -> CellRecord:
        rec = self.cells[cell]
        if rec.health is not state:
            raise InvariantError(f"cell {cell} {what} while {rec.health.value}")
        return rec
