"""KV-migration endpoints of the torch engine (see `kv_migration.py` for the protocol).

| endpoint | body | answer |
|---|---|---|
| `POST /kv/pin` (source) | `KVPinBody` {rid \\| token_ids, ttl_s?, abort} | 200 `KVExport`; 400 unknown rid / bad body; 409 nothing to migrate, migration off or unavailable |
| `POST /kv/takeover` (destination) | `KVTakeoverBody` {export, token_ids?, timeout_s} | `KVTakeoverResult`: 200 installed, 409 refused, 502 failed |
| `POST /kv/ack` (source) | `KVAckBody` {migration_id} | 200 `{migration_id, released_blocks}`; 404 no such pin (expired / released) |
| `POST /kv/release` (source) | `KVAckBody` | same as ack, counted as given up |
| `GET /kv/migrations` | | layout, live pins and adopted sequences, counters |
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gyre_cell.errors import EngineInputError

from .core import TorchEngine
from .kv_migration import KVAckBody, KVMigrationError, KVPinBody, KVTakeoverBody

TAKEOVER_STATUS = {"installed": 200, "refused": 409, "failed": 502}


def add_kv_routes(
    app: FastAPI, engine: TorchEngine, parse_body: Callable[..., Awaitable[Any]], *, api_key: str | None
) -> None:
    mig = engine.migrator
    mig.api_key = api_key

    def err(message: str, status: int) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    @app.post("/kv/pin")
    async def kv_pin(request: Request) -> JSONResponse:
        body = await parse_body(request, KVPinBody)
        try:
            export = await asyncio.to_thread(
                mig.pin, rid=body.rid, token_ids=body.token_ids, ttl_s=body.ttl_s, abort=body.abort
            )
        except KVMigrationError as e:
            return err(str(e), 409)
        return JSONResponse(export.model_dump(mode="json"))

    @app.post("/kv/takeover")
    async def kv_takeover(request: Request) -> JSONResponse:
        body = await parse_body(request, KVTakeoverBody)
        res = await asyncio.to_thread(
            mig.takeover, body.export, token_ids=body.token_ids, timeout_s=body.timeout_s
        )
        return JSONResponse(res.model_dump(mode="json"), status_code=TAKEOVER_STATUS[res.status])

    async def _end(request: Request, fn: Callable[[str], int]) -> JSONResponse:
        body = await parse_body(request, KVAckBody)
        try:
            n = await asyncio.to_thread(fn, body.migration_id)
        except EngineInputError as e:
            return err(str(e), 404)
        return JSONResponse({"migration_id": body.migration_id, "released_blocks": n})

    @app.post("/kv/ack")
    async def kv_ack(request: Request) -> JSONResponse:
        return await _end(request, mig.ack)

    @app.post("/kv/release")
    async def kv_release(request: Request) -> JSONResponse:
        return await _end(request, mig.release)

    @app.get("/kv/migrations")
    async def kv_migrations() -> dict[str, Any]:
        return await asyncio.to_thread(mig.snapshot)
