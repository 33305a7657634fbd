"""Admin API (needs the admin token as `Authorization: Bearer <token>` or `x-admin-token`).

| method + path | body | answer |
|---|---|---|
| `POST /admin/executions` | `{execution_id?, group_id?, route?: [url], metadata?}` | `{execution_id, group_id, credential}` |
| `GET /admin/executions/{id}` | | `{execution_id, group_id, ended, calls, active_calls, route}` |
| `POST /admin/executions/{id}/end` | | `{execution_id, ended: true}` |
| `PUT /admin/executions/{id}/route` | `{engines: [url] \\| null}` | `{execution_id, route}` |
| `POST /admin/executions/{id}/export` | `{j_max?, seed?, include_other?, path?}` | `{trajectories: [...]}` (and JSONL/Parquet at `path`, which must resolve under STORE/exports or an `--export-dir`) |
| `GET /admin/quarantine` | | `{quarantined: [{execution_id, group_id, log, reason}]}` |
| `GET /admin/engines` / `PUT /admin/routes` | `{engines: [url]}` | engine list |
| `POST /admin/engines/drain` | `{engine, abort_inflight?: true, timeout_s?}` | `{engine, inflight_at_drain, kv_migration}` |
| `GET /admin/kv/reroutes` | | `{kv_migration, reroutes: [{rid, kind, source, destination, status, migrated_tokens, served_tokens, recomputed_tokens, ...}]}` (the last 1024 moves) |
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gyre_tito.conversation import ProtocolError
from gyre_tito.execution import Execution

__all__ = [
    "admin_router", "check_export_dirs", "export_roots", "export_target", "export_trajectories", "has_admin_token",
]  # fmt: skip


def _err(e: ProtocolError) -> JSONResponse:
    return JSONResponse(
        {"type": "error", "error": {"type": e.kind, "message": e.message}}, status_code=e.status
    )


EXPORTS_SUBDIR = "exports"
"""Exports inside the store go under STORE/exports/: the proxy's own files (registry, records, config) never do."""


def export_roots(config) -> list[Path]:
    """Where admin export may write: STORE/exports and each `--export-dir` (resolved)."""
    return [Path(config.store).resolve() / EXPORTS_SUBDIR, *(Path(d).resolve() for d in config.export_dirs)]


def protected_paths(config) -> list[Path]:
    """The proxy's own state: an export may never write there, and no export root may contain or lie in it."""
    store = Path(config.store).resolve()
    return [store / "records", store / "executions.jsonl", store / "config.json", store / "quarantine"]


def check_export_dirs(config) -> None:
    """Refuse (ValueError) an `--export-dir` that overlaps the proxy's own files: an export could overwrite them."""
    for root in export_roots(config):
        for own in protected_paths(config):
            if root == own or own.is_relative_to(root) or root.is_relative_to(own):
                raise ValueError(f"export dir {str(root)!r} overlaps the proxy's own state {str(own)!r}")


def export_target(proxy, path: Any) -> Path:
    """Where an export may write: a resolved path under STORE/exports or an `--export-dir` root (else a 400)."""
    roots = export_roots(proxy.config)
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise ProtocolError(
            400, "invalid_request_error", "path: must be a non-empty string (at most 4096 chars)"
        )
    try:
        target = Path(
            path
        ).resolve()  # `..` and symlinks resolved: what is checked is where the bytes would go
    except (OSError, RuntimeError) as e:
        raise ProtocolError(400, "invalid_request_error", f"path: {e}") from None
    inside = any(target != root and target.is_relative_to(root) for root in roots)
    own = any(target == p or target.is_relative_to(p) for p in protected_paths(proxy.config))
    if not inside or own:
        raise ProtocolError(
            400,
            "invalid_request_error",
            f"path: {path[:300]!r} resolves to {str(target)[:300]!r}, outside the allowed export roots "
            f"{[str(r) for r in roots]} (STORE/{EXPORTS_SUBDIR} and the --export-dir directories)",
        )
    if target.suffix not in (".jsonl", ".parquet"):
        raise ProtocolError(
            400, "invalid_request_error", f"path: {path[:300]!r} must end in .jsonl or .parquet"
        )
    return target


def _write_atomically(target: Path, trajs) -> None:
    """Write beside the target and rename over it: a reader never sees half a file, and a hard link planted at the
    target is replaced rather than written through."""
    import os
    import secrets

    from gyre_tito.export import write_trajectories

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.{secrets.token_hex(6)}.tmp{target.suffix}")
    try:
        write_trajectories(tmp, trajs)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def path_repr(p: Path) -> str:
    return repr(str(p)[:300])


def export_trajectories(proxy, execution_id: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Select (J_max admission) and materialise an execution's trajectories; optionally write them to `path`."""
    from gyre_tito.materialize import placeholder_trajectory, select_trajectories
    from gyre_tito.selection import SelectionConfig
    from gyre_tito.types import ROLE_PRIORITY

    ex = proxy.get(execution_id)
    target = export_target(proxy, body["path"]) if body.get("path") is not None else None
    priority = (*ROLE_PRIORITY, "other") if body.get("include_other") else ROLE_PRIORITY
    j_max, seed = body.get("j_max", 5), body.get("seed", 0)
    for name, v, lo, hi in (("j_max", j_max, 1, 10_000), ("seed", seed, -(2**63), 2**63 - 1)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ProtocolError(400, "invalid_request_error", f"{name}: must be an integer in [{lo}, {hi}]")
    cfg = SelectionConfig(j_max=j_max, seed=seed, priority=priority)
    if body.get("no_work"):
        trajs = [placeholder_trajectory(ex.id, ex.group_id)]
    else:
        trajs = select_trajectories(proxy.tree(execution_id), ex.group_id, cfg)
    if target is not None:
        try:
            _write_atomically(target, trajs)
        except OSError as e:
            raise ProtocolError(
                400, "invalid_request_error", f"path: cannot write {path_repr(target)}: {e}"
            ) from None
    return [orjson.loads(t.model_dump_json()) for t in trajs]


def has_admin_token(proxy, req: Request) -> bool:
    """The request carries the proxy's admin token (``X-Admin-Token`` or ``Authorization: Bearer``); never true when
    the proxy has none."""
    token = proxy.config.admin_token
    given = req.headers.get("x-admin-token") or ""
    auth = req.headers.get("authorization", "")
    if not given and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return bool(token) and hmac.compare_digest(given.encode(), token.encode())


def admin_router(proxy) -> APIRouter:
    r = APIRouter(prefix="/admin")

    async def guard(req: Request) -> dict[str, Any]:
        if not has_admin_token(proxy, req):
            raise ProtocolError(401, "authentication_error", "admin token missing or wrong")
        raw = await req.body()
        if not raw:
            return {}
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ProtocolError(400, "invalid_request_error", f"body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise ProtocolError(400, "invalid_request_error", "body must be a JSON object")
        return body

    def _urls(v: Any, field: str) -> list[str] | None:
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(u, str) and u.startswith("http") for u in v):
            raise ProtocolError(
                400, "invalid_request_error", f"{field}: must be a list of http(s) URLs or null"
            )
        return [u.rstrip("/") for u in v]

    def summary(ex) -> dict[str, Any]:
        return {
            "execution_id": ex.id,
            "group_id": ex.group_id,
            "ended": ex.ended,
            "calls": proxy.calls(ex.id),
            "active_calls": proxy.pool.active.get(ex.id, 0),  # model calls of it running now
            "route": ex.route,
        }

    @r.post("/executions")
    async def register(req: Request):
        try:
            body = await guard(req)
            eid, gid = body.get("execution_id"), body.get("group_id")
            for name, v in (("execution_id", eid), ("group_id", gid)):
                if v is not None and (not isinstance(v, str) or not v):
                    raise ProtocolError(400, "invalid_request_error", f"{name}: must be a non-empty string")
            meta = body.get("metadata") or {}
            if not isinstance(meta, dict):
                raise ProtocolError(400, "invalid_request_error", "metadata: must be an object")
            ex, cred = proxy.register(eid, gid, _urls(body.get("route"), "route"), meta)
            return summary(ex) | {"credential": cred}
        except ProtocolError as e:
            return _err(e)

    @r.get("/executions/{eid}")
    async def info(eid: str, req: Request):
        try:
            await guard(req)
            return summary(proxy.get(eid))
        except ProtocolError as e:
            return _err(e)

    @r.post("/executions/{eid}/end")
    async def end(eid: str, req: Request):
        try:
            await guard(req)
            return summary(proxy.end(eid))
        except ProtocolError as e:
            return _err(e)

    @r.put("/executions/{eid}/route")
    async def route(eid: str, req: Request):
        try:
            body = await guard(req)
            proxy.set_route(eid, _urls(body.get("engines"), "engines"))
            return summary(proxy.get(eid))
        except ProtocolError as e:
            return _err(e)

    @r.post("/executions/{eid}/export")
    async def export_(eid: str, req: Request):
        try:
            body = await guard(req)
            ex = proxy.get(eid)
            if isinstance(ex, Execution):
                async with ex.lock:
                    trajs = export_trajectories(proxy, eid, body)
            else:  # ended: its tree is reloaded from the log for this export only (off the event loop)
                trajs = await asyncio.to_thread(export_trajectories, proxy, eid, body)
            return {"execution_id": eid, "trajectories": trajs}
        except ProtocolError as e:
            return _err(e)
        except (ValueError, TypeError) as e:
            return _err(ProtocolError(400, "invalid_request_error", str(e)))

    @r.get("/quarantine")
    async def quarantine(req: Request):
        try:
            await guard(req)
            return {
                "quarantined": [
                    {"execution_id": q.id, "group_id": q.group_id, "log": str(q.log_path), "reason": q.reason}
                    for q in proxy.quarantined.values()
                ]
            }
        except ProtocolError as e:
            return _err(e)

    @r.get("/engines")
    async def engines(req: Request):
        try:
            await guard(req)
            return {"engines": proxy.pool.engines()}
        except ProtocolError as e:
            return _err(e)

    @r.get("/kv/reroutes")
    async def kv_reroutes(req: Request):
        try:
            await guard(req)
            # one row per moved request or context, oldest first; served/recomputed stay null until its next call
            return {
                "kv_migration": dict(proxy.pool.kv_stats),
                "reroutes": [asdict(x) for x in proxy.pool.reroutes],
            }
        except ProtocolError as e:
            return _err(e)

    @r.put("/routes")
    async def routes(req: Request):
        try:
            body = await guard(req)
            unknown = sorted(set(body) - {"engines"})
            if unknown or "engines" not in body or body["engines"] is None:
                # a misspelled or missing key must never read as "no engines" and empty the route
                raise ProtocolError(
                    400,
                    "invalid_request_error",
                    "body must be {'engines': [url, ...]}" + (f"; unknown keys {unknown}" if unknown else ""),
                )
            urls = _urls(body["engines"], "engines") or []
            proxy.pool.set_engines(urls)
            proxy.config.engines = urls
            proxy.refresh_context_limit()
            return {"engines": proxy.pool.engines()}
        except ProtocolError as e:
            return _err(e)

    @r.post("/engines/drain")
    async def drain(req: Request):
        try:
            body = await guard(req)
            url = body.get("engine")
            if not isinstance(url, str):
                raise ProtocolError(400, "invalid_request_error", "engine: required URL string")
            timeout_s = body.get("timeout_s", 30)
            if (
                isinstance(timeout_s, bool)
                or not isinstance(timeout_s, int | float)
                or not 0 <= timeout_s <= 3600
            ):
                raise ProtocolError(
                    400, "invalid_request_error", "timeout_s: must be a number of seconds in [0, 3600]"
                )
            abort = body.get("abort_inflight", True)
            if not isinstance(abort, bool):
                raise ProtocolError(400, "invalid_request_error", "abort_inflight: must be a boolean")
            try:
                n = await proxy.pool.drain(url, abort, float(timeout_s))
            except KeyError:
                raise ProtocolError(404, "not_found_error", f"no engine {url!r}") from None
            # kv_migration: the pool's KV-migration totals after this drain (reroutes, migrated, tokens, bytes)
            return {
                "engine": url.rstrip("/"),
                "inflight_at_drain": n,
                "kv_migration": dict(proxy.pool.kv_stats),
            }
        except ProtocolError as e:
            return _err(e)

    return r
