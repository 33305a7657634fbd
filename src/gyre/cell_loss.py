"""A satellite cell whose worker died mid-run: the controller goes on with the other cells.

What happens when a call to satellite cell i fails (its event stream, a role switch, a join, a weight load):
- the worker is asked for its status; if it answers, the failure was something else and the run stops as before;
- if it does not, the cell is lost: the policy gets `CellLost(i)` (traced as `cell_lost`), which takes the cell out of
  every later role decision and reroutes its executions to free slots (or cancels them when there is none: they are
  accounted like any cancelled execution, their groups refilled); the proxy stops routing to its engine at once, and
  a call that was streaming from it fails over to another engine inside the proxy;
- its claimed but unfinished micro-steps are requeued by gyre-train's coordinator (the control connection closed),
  which also leaves it out of every later batch's collectives: the reduce runs over the remaining members' group
  (a prefix group, or a fresh group of exactly those ranks), so the dead rank of the fixed-K gloo world is never
  contacted again. A satellite that dies inside the reduce itself is not covered (gloo's timeout ends the run).

The core (cell 0) holds the optimizer: its loss still ends the run (`gyre run --resume` continues it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gyre_sched import events as ev
from gyre_sched.types import CellRole

if TYPE_CHECKING:
    from gyre.controller import Controller

log = logging.getLogger("gyre")

__all__ = ["CellLosses"]

STATUS_TIMEOUT_S = 10.0
"""A worker that does not answer its status within this long after a failed call is taken as dead."""


class CellLosses:
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.lost: set[int] = set()

    async def absorb(self, cell: int | None, exc: BaseException) -> bool:
        """True if `exc` came from satellite `cell` having died (then the run goes on without it)."""
        if cell is None or cell == 0 or isinstance(exc, asyncio.CancelledError):
            return False
        if cell in self.lost:
            return True
        if await self._answers(cell):
            return False
        if cell in self.lost:  # another failed call found it dead meanwhile
            return True
        self.lost.add(cell)
        log.warning("cell %d lost (%s: %s): the run goes on with the other cells; see %s", cell,
                    type(exc).__name__, exc, self.c.run_dir / "logs" / f"cell-{cell}.log")  # fmt: skip
        self.c.events.put_nowait(ev.CellLost(cell))
        roles = self.c.policy.roles
        serving = [c.base_url for i, c in enumerate(self.c.cells)
                   if i not in self.lost and roles[i] is CellRole.ROLLOUT]  # fmt: skip
        try:
            await self.c.runner.admin_call(
                "PUT", "/routes", {"engines": serving + [s.base_url for s in self.c.standalone]}
            )
        except Exception as routes_failed:  # the proxy refused: that stops the run, as any failed part does
            self.c.events.put_nowait(routes_failed)
        return True

    async def check(self, targets: Sequence, results: Sequence) -> list:
        """Results of one call per target (gather with return_exceptions): a dead satellite's failure is absorbed,
        any other failure is raised; returns the successful results."""
        ok = []
        for target, result in zip(targets, results, strict=True):
            if not isinstance(result, BaseException):
                ok.append(result)
                continue
            cell = next((i for i, c in enumerate(self.c.cells) if c is target), None)
            if not await self.absorb(cell, result):
                raise result
        return ok

    async def _answers(self, cell: int) -> bool:
        try:
            await asyncio.wait_for(self.c.cells[cell].status(), timeout=STATUS_TIMEOUT_S)
        except Exception:
            return False
        return True
