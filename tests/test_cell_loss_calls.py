"""A call to a satellite whose port never answers gives up once the cell is found lost (gyre.run.cell_effects).

A killed cell's port taken by a listener that never answers (or a host gone quiet) keeps an HTTP call open for the
client's whole timeout (600 s); a publication waiting on such a load held stop 32's CI run for good. Here the
port is a real loopback socket that listens and never answers; the loss is found by the same `absorb` the
controller's event pump calls (its status probe times out too), and the load in flight ends with it.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

import gyre.run.cell_effects as cell_effects
from gyre.run.cell_effects import CellEffects
from gyre.run.engine_routes import EngineRoutes
from gyre_cell.errors import CellCommandError
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import PublishedWeights
from gyre_sched import events as ev
from gyre_sched.types import CellRole


async def _no_admin(method: str, path: str, body: dict) -> None:
    raise AssertionError(
        "the loss itself calls no proxy: the controller puts the routes when the policy heard it"
    )


def test_a_load_to_a_silent_cell_ends_when_the_cell_is_found_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(cell_effects, "STATUS_TIMEOUT_S", 0.5)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts into its backlog, never reads or answers

    async def body() -> None:
        core = CellWorkerClient("http://127.0.0.1:9")  # never called: the core is never lost
        cell = CellWorkerClient(f"http://127.0.0.1:{silent.getsockname()[1]}")
        reported: list = []
        down: set[int] = set()  # the policy's view: it has not heard of the loss yet
        effects = CellEffects(
            [core, cell],
            reported.append,
            lambda: PublishedWeights(version=3),
            lambda: down,
            tmp_path,
            reform_timeout_s=5.0,
        )
        routes = EngineRoutes(
            _no_admin, [core, cell], [], lambda: [CellRole.TRAINING, CellRole.ROLLOUT], effects.unreachable
        )
        assert routes.engines() == [cell.engine_url]
        load = asyncio.create_task(effects.unless_lost(1, cell.load_weights(PublishedWeights(version=3))))
        assert await effects.absorb(1, CellCommandError("its event stream ended"))
        with pytest.raises(CellCommandError, match="cell 1 was lost while the call was under way"):
            await asyncio.wait_for(load, 5)
        assert reported == [ev.CellLost(1)]
        assert routes.engines() == []  # no engine of a cell found dead is routed to, before the policy hears
        # found already: no 2nd report
        assert await effects.absorb(1, CellCommandError("a second failed call"))
        down.add(1)
        effects.heard(1)
        assert reported == [ev.CellLost(1)] and effects.unreachable() == {1}
        # Lost already: a later call to it gives up at once; a call to the core is never cut.
        with pytest.raises(CellCommandError):
            await asyncio.wait_for(effects.unless_lost(1, cell.load_weights(PublishedWeights(version=3))), 5)
        assert await effects.unless_lost(0, asyncio.sleep(0, result="core")) == "core"
        await cell.aclose()
        await core.aclose()

    try:
        asyncio.run(body())
    finally:
        silent.close()
