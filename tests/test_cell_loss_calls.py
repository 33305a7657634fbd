"""A call to a satellite whose port never answers gives up once the cell is found lost (gyre.cell_loss).

A killed cell's port taken by a listener that never answers (or a host gone quiet) keeps an HTTP call open for the
client's whole timeout (600 s); a publication waiting on such a load held stop 32's CI run for good. Here the
port is a real loopback socket that listens and never answers; the loss is found by the same `absorb` the
controller's event pump calls (its status probe times out too), and the load in flight ends with it.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

import gyre.cell_loss as cell_loss
from gyre.cell_loss import CellLosses
from gyre.engine_routes import EngineRoutes
from gyre_cell.worker_client import CellCommandError, CellWorkerClient
from gyre_cell.worker_types import PublishedWeights
from gyre_sched.types import CellRole


class _Runner:
    """The proxy's admin API as the loss path uses it: the routes it was told."""

    def __init__(self) -> None:
        self.routes: list[dict] = []

    async def admin_call(self, method: str, path: str, body: dict) -> None:
        self.routes.append(body)


class _Policy:
    def __init__(self) -> None:
        self.roles = [CellRole.TRAINING, CellRole.ROLLOUT]


class _Controller:
    """What `CellLosses` reads of the controller: its cells, event queue, proxy runner, policy and run directory."""

    def __init__(self, cells: list[CellWorkerClient], run_dir: Path) -> None:
        self.cells, self.standalone, self.run_dir = cells, [], run_dir
        self.events: asyncio.Queue = asyncio.Queue()
        self.runner, self.policy = _Runner(), _Policy()
        self.losses: CellLosses | None = None
        self.routes = EngineRoutes(self.runner.admin_call, cells, [], lambda: self.policy.roles,
                                   lambda: self.losses.lost)  # fmt: skip


def test_a_load_to_a_silent_cell_ends_when_the_cell_is_found_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(cell_loss, "STATUS_TIMEOUT_S", 0.5)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts into its backlog, never reads or answers

    async def body() -> None:
        core = CellWorkerClient("http://127.0.0.1:9")  # never called: the core is never lost
        cell = CellWorkerClient(f"http://127.0.0.1:{silent.getsockname()[1]}")
        controller = _Controller([core, cell], tmp_path)
        losses = controller.losses = CellLosses(controller)  # type: ignore[arg-type]
        load = asyncio.create_task(losses.unless_lost(1, cell.load_weights(PublishedWeights(version=3))))
        assert await losses.absorb(1, CellCommandError("its event stream ended"))
        with pytest.raises(CellCommandError, match="cell 1 was lost while the call was under way"):
            await asyncio.wait_for(load, 5)
        assert losses.lost == {1} and isinstance(controller.events.get_nowait().cell, int)
        assert controller.runner.routes == [{"engines": []}]  # no engine of a lost cell is routed to
        # Lost already: a later call to it gives up at once; a call to the core is never cut.
        with pytest.raises(CellCommandError):
            await asyncio.wait_for(losses.unless_lost(1, cell.load_weights(PublishedWeights(version=3))), 5)
        assert await losses.unless_lost(0, asyncio.sleep(0, result="core")) == "core"
        await cell.aclose()
        await core.aclose()

    try:
        asyncio.run(body())
    finally:
        silent.close()
