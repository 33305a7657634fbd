"""The controller's cell client never sends a command on a connection the worker's server may be closing.

uvicorn closes an idle keep-alive connection after its timeout (5 s by default); a client that keeps connections
as long (httpx's default) can send a request on one at the very moment it is closed, and the command fails with an
empty ``ReadError`` (a demo run ended on ``/cell/groups: ReadError`` this way under load). The client drops idle
connections after ``KEEPALIVE_EXPIRY_S``, well inside any server's keep-alive, and the worker keeps them 75 s.
"""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from fastapi import FastAPI, Request

from gyre_cell.worker_client import KEEPALIVE_EXPIRY_S, CellWorkerClient


def test_an_idle_connection_is_dropped_by_the_client_before_a_default_server_would_close_it() -> None:
    app, ports = FastAPI(), []

    @app.get("/cell/status")
    async def status(request: Request) -> dict:
        ports.append(request.client.port)  # a new connection comes from a new source port
        return {"cell": 0, "kind": "elastic", "ready": True, "role": "rollout", "weight_version": "v0"}

    # keep-alive 5 s
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # start-up poll, not an ordering assumption
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]

    async def run() -> None:
        client = CellWorkerClient(f"http://127.0.0.1:{port}")
        try:
            await client.status()
            await client.status()  # back to back: the connection is reused
            # idle past the client's expiry, still inside the server's 5 s: a connection kept this long could meet
            # the server's close; the client must open a fresh one instead
            await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)
            assert (await client.status()).ready
        finally:
            await client.aclose()

    try:
        asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(10)
    assert KEEPALIVE_EXPIRY_S + 0.5 < 5.0
    assert ports[0] == ports[1] and ports[2] != ports[1], ports
