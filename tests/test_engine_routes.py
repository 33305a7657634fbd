"""The proxy's engine list (gyre.run.engine_routes) against a real TITO proxy and real (scripted) engines on loopback.

Seen in a fault run: a restored cell's list was computed while cell 0 was switching to training (its engine not
drained yet), the proxy dropped cell 0's engine, and cell 0's drain was a 404 that ended the run
("proxy admin POST /engines/drain: 404 ... no engine"). Here that order is played exactly, then raced.
"""

from __future__ import annotations

import asyncio

import httpx

from gyre.run.engine_routes import EngineRoutes
from gyre_cell.worker_client import CellWorkerClient
from gyre_sched.types import CellRole
from gyre_tito.proxy import ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer


def test_a_cell_switching_to_training_stays_listed_until_its_drain(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    engines = [
        ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), rules=[ScriptRule(reply="hi")]))
        for _ in range(3)
    ]
    urls = [e.start().rstrip("/") for e in engines]
    roles = [CellRole.ROLLOUT] * 3
    lost: set[int] = set()
    config = ProxyConfig(engines=urls, tokenizer=str(tok), store=str(tmp_path / "store"), admin_token="adm")
    try:
        with ProxyServer(config) as srv:

            def pool() -> set[str]:
                return {e["url"] for e in srv.proxy.pool.engines()}

            async def body() -> None:
                async with httpx.AsyncClient(
                    base_url=srv.url + "/admin", headers={"x-admin-token": "adm"}, timeout=30
                ) as admin:

                    async def admin_call(method: str, path: str, payload: dict) -> dict:
                        r = await admin.request(method, path, json=payload)
                        if r.status_code >= 400:  # as ExecutionRunner.admin_call: a refusal fails the caller
                            raise RuntimeError(f"proxy admin {method} {path}: {r.status_code} {r.text}")
                        return r.json()

                    cells = [CellWorkerClient(u) for u in urls]
                    routes = EngineRoutes(admin_call, cells, [], lambda: roles, lambda: lost)
                    lost.add(1)  # cell 1 lost: its engine leaves the list
                    await routes.put()
                    assert pool() == {urls[0], urls[2]}

                    # Cell 0 begins its switch to training; cell 1's restore lists itself before cell 0's drain.
                    roles[0] = CellRole.TO_TRAINING
                    routes.switching_to_training(0)
                    await routes.put(also=1)
                    assert pool() == set(urls)  # cell 0 still listed: its drain has not happened
                    await routes.drain(0)  # a 404 that ended the run when the restore's list had dropped it
                    assert pool() == {urls[1], urls[2]}
                    routes.switch_ended(0)
                    lost.discard(1)
                    await routes.put()
                    assert pool() == {urls[1], urls[2]}  # drained: never listed again while in training

                    # Raced: cell 2 switches while lists are put concurrently; whatever the order, its drain
                    # succeeds and no list put after it names its engine.
                    roles[0] = CellRole.TRAINING
                    roles[2] = CellRole.TO_TRAINING
                    routes.switching_to_training(2)
                    await asyncio.gather(
                        routes.put(also=0), routes.drain(2), routes.put(), routes.put(also=1)
                    )
                    routes.switch_ended(2)
                    await routes.put()
                    assert pool() == {urls[1]}
                    for c in cells:
                        await c.aclose()

            asyncio.run(body())
    finally:
        for e in engines:
            e.stop()
