"""The proxy's engine list, with one owner.

The controller, a cell's role switch, a cell's loss and its restore all change which engines the TITO proxy routes
new calls to. Each used to compute the list itself from the roles and PUT it: a restore that computed it while
cell 0 was switching to training (role TO_TRAINING, its engine not drained yet) left cell 0 out, the proxy dropped
its engine, and cell 0's drain a moment later was a 404 that ended the run. Here the list is computed in one
place, a cell switching to training stays on it until its drain, and lists and drains go out one at a time, so a
list computed before a drain cannot land after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from gyre_cell.worker_client import CellWorkerClient
from gyre_sched.types import CellRole

AdminCall = Callable[[str, str, dict], Awaitable[dict | None]]


class EngineRoutes:
    """`admin_call(method, path, body)`: the proxy's admin API; `roles()` and `lost()`: the policy's cell roles and
    the cells found lost, read at each change."""

    def __init__(
        self,
        admin_call: AdminCall,
        cells: Sequence[CellWorkerClient],
        standalone: Sequence[CellWorkerClient],
        roles: Callable[[], Sequence[CellRole]],
        lost: Callable[[], set[int]],
    ) -> None:
        self._admin_call, self._cells, self._standalone = admin_call, cells, standalone
        self._roles, self._lost = roles, lost
        self._lock = asyncio.Lock()
        self._undrained: set[int] = set()

    def switching_to_training(self, cell: int) -> None:
        """`cell` began its switch to training: its engine stays listed until `drain(cell)` took it out."""
        self._undrained.add(cell)

    def switch_ended(self, cell: int) -> None:
        """However `cell`'s switch ended (drained or failed before), it is not listed for that switch any more."""
        self._undrained.discard(cell)

    def engines(self, also: int | None = None) -> list[str]:
        """Cells serving rollout that are not lost, cells switching to training not drained yet, `also` (a cell
        about to serve: just switched to rollout, or restored), then the standalone pool."""
        roles, lost = self._roles(), self._lost()
        cells = [
            c.engine_url
            for i, c in enumerate(self._cells)
            if i == also or (i not in lost and (roles[i] is CellRole.ROLLOUT or i in self._undrained))
        ]
        return cells + [s.engine_url for s in self._standalone]

    async def put(self, also: int | None = None) -> None:
        """Give the proxy the list as the roles are now."""
        async with self._lock:
            await self._admin_call("PUT", "/routes", {"engines": self.engines(also)})

    async def drain(self, cell: int) -> dict | None:
        """Take `cell`'s engine off the list (its in-flight calls continue elsewhere); the proxy's KV-migration
        totals after it."""
        async with self._lock:
            try:
                drained = await self._admin_call(
                    "POST", "/engines/drain", {"engine": self._cells[cell].engine_url}
                )
            finally:
                self._undrained.discard(cell)
        return drained.get("kv_migration") if isinstance(drained, dict) else None
