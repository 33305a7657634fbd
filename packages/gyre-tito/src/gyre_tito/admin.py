"""Admin API (needs the admin token as `Authorization: Bearer <token>` or `x-admin-token`).

| method + path | body | answer |
|---|---|---|
| `POST /admin/executions` | `RegisterRequest`: `{execution_id?, group_id?, route?: [url], metadata?}` | `{execution_id, group_id, credential}` |
| `GET /admin/executions/{id}` | | `{execution_id, group_id, ended, calls, active_calls, route}` |
| `POST /admin/executions/{id}/end` | | `{execution_id, ended: true}` |
| `PUT /admin/executions/{id}/route` | `RouteRequest`: `{engines: [url] \\| null}` | `{execution_id, route}` |
| `POST /admin/executions/{id}/export` | `ExportRequest`: `{j_max?, seed?, include_other?, path?}` | `{trajectories: [...]}` (and JSONL/Parquet at `path`, which must resolve under STORE/exports or an `--export-dir`) |
| `GET /admin/quarantine` | | `{quarantined: [{execution_id, group_id, log, reason}]}` |
| `GET /admin/engines` / `PUT /admin/routes` | `RoutesRequest`: `{engines: [url]}` | engine list |
| `POST /admin/engines/drain` | `DrainRequest`: `{engine, abort_inflight?: true, timeout_s?}` | `{engine, inflight_at_drain, kv_migration}` |
| `GET /admin/kv/reroutes` | | `{kv_migration, reroutes: [{rid, kind, source, destination, status, migrated_tokens, served_tokens, recomputed_tokens, ...}]}` (the last 1024 moves) |

The bodies are the pydantic models of `gyre_tito.admin_models`. Every route depends on `admin_proxy` (the token
check: 401 without it); errors are answered in the Anthropic shape `{"type": "error", "error": {type, message}}` by
one handler (`AdminRoute`): a body that does not fit its model is a 400 naming each offending field, never a 500.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from gyre_tito.admin_models import DrainRequest, ExportRequest, RegisterRequest, RouteRequest, RoutesRequest
from gyre_tito.errors import ProtocolError
from gyre_tito.execution import Execution

__all__ = [
    "ROUTES",
    "AdminRoute",
    "DrainRequest",
    "ExportRequest",
    "RegisterRequest",
    "RouteRequest",
    "RoutesRequest",
    "admin_proxy",
    "admin_router",
    "check_export_dirs",
    "export_roots",
    "export_target",
    "export_trajectories",
    "has_admin_token",
]


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
        # `..` and symlinks resolved: what is checked is where the bytes would go
        target = Path(path).resolve()
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


def export_trajectories(proxy, execution_id: str, request: ExportRequest) -> list[dict[str, Any]]:
    """Select (J_max admission) and materialise an execution's trajectories; optionally write them to `path`."""
    from gyre_tito.materialize import placeholder_trajectory, select_trajectories
    from gyre_tito.selection import SelectionConfig
    from gyre_tito.types import ROLE_PRIORITY

    ex = proxy.get(execution_id)
    target = export_target(proxy, request.path) if request.path is not None else None
    priority = (*ROLE_PRIORITY, "other") if request.include_other else ROLE_PRIORITY
    cfg = SelectionConfig(j_max=request.j_max, seed=request.seed, priority=priority)
    if request.no_work:
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


# ---- the router: a token dependency, body models, one error handler --------------------------------------------


async def admin_proxy(req: Request) -> Any:
    """The app's proxy (`app.state.proxy`), for a request that carries its admin token: every admin route's
    dependency, so a route cannot forget the check. Without the token: 401 before the body is read."""
    proxy = req.app.state.proxy
    if not has_admin_token(proxy, req):
        raise ProtocolError(401, "authentication_error", "admin token missing or wrong")
    return proxy


def _body[M: BaseModel](model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency giving the request body as `model`. The raw bytes are parsed whatever the content type (curl's
    `-d` sends form-encoded); an empty body is `{}`, so a route whose fields all have defaults needs none."""

    async def parse(req: Request) -> M:
        return model.model_validate_json(await req.body() or b"{}")

    return parse


Admin = Annotated[Any, Depends(admin_proxy)]


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'body'}: {x['msg']}" for x in e.errors())


class AdminRoute(APIRoute):
    """The admin routes' one error handler: a `ProtocolError` is answered with its status, a body that does not fit
    its model with 400 and each offending field (before: a hand check per field, and a 500 for any it missed)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()

        async def handler(req: Request) -> Response:
            try:
                return await handle(req)
            except ValidationError as e:
                error = ProtocolError(400, "invalid_request_error", f"invalid request body: {_problems(e)}")
            except ProtocolError as e:
                error = e
            body = {"type": "error", "error": {"type": error.kind, "message": error.message}}
            return JSONResponse(body, status_code=error.status)

        return handler


def _summary(proxy, ex) -> dict[str, Any]:
    return {
        "execution_id": ex.id,
        "group_id": ex.group_id,
        "ended": ex.ended,
        "calls": proxy.calls(ex.id),
        "active_calls": proxy.pool.active.get(ex.id, 0),  # model calls of it running now
        "route": ex.route,
    }


async def _register(proxy: Admin, body: Annotated[RegisterRequest, Depends(_body(RegisterRequest))]):
    ex, cred = proxy.register(body.execution_id, body.group_id, body.route, body.metadata or {})
    return _summary(proxy, ex) | {"credential": cred}


async def _info(eid: str, proxy: Admin):
    return _summary(proxy, proxy.get(eid))


async def _end(eid: str, proxy: Admin):
    return _summary(proxy, proxy.end(eid))


async def _route(eid: str, proxy: Admin, body: Annotated[RouteRequest, Depends(_body(RouteRequest))]):
    proxy.set_route(eid, body.engines)
    return _summary(proxy, proxy.get(eid))


async def _export(eid: str, proxy: Admin, body: Annotated[ExportRequest, Depends(_body(ExportRequest))]):
    ex = proxy.get(eid)
    try:
        if isinstance(ex, Execution):
            async with ex.lock:
                trajs = export_trajectories(proxy, eid, body)
        else:  # ended: its tree is reloaded from the log for this export only (off the event loop)
            trajs = await asyncio.to_thread(export_trajectories, proxy, eid, body)
    except (ValueError, TypeError) as e:  # the selection refusing this execution's tree
        raise ProtocolError(400, "invalid_request_error", str(e)) from None
    return {"execution_id": eid, "trajectories": trajs}


async def _quarantine(proxy: Admin):
    return {
        "quarantined": [
            {"execution_id": q.id, "group_id": q.group_id, "log": str(q.log_path), "reason": q.reason}
            for q in proxy.quarantined.values()
        ]
    }


async def _engines(proxy: Admin):
    return {"engines": proxy.pool.engines()}


async def _kv_reroutes(proxy: Admin):
    # one row per moved request or context, oldest first; served/recomputed stay null until its next call
    return {"kv_migration": dict(proxy.pool.kv_stats), "reroutes": [asdict(x) for x in proxy.pool.reroutes]}


async def _routes(proxy: Admin, body: Annotated[RoutesRequest, Depends(_body(RoutesRequest))]):
    proxy.pool.set_engines(body.engines)
    proxy.config.engines = body.engines
    proxy.refresh_context_limit()
    return {"engines": proxy.pool.engines()}


async def _drain(proxy: Admin, body: Annotated[DrainRequest, Depends(_body(DrainRequest))]):
    try:
        n = await proxy.pool.drain(body.engine, body.abort_inflight, body.timeout_s)
    except KeyError:
        raise ProtocolError(404, "not_found_error", f"no engine {body.engine!r}") from None
    # kv_migration: the pool's KV-migration totals after this drain (reroutes, migrated, tokens, bytes)
    return {
        "engine": body.engine.rstrip("/"),
        "inflight_at_drain": n,
        "kv_migration": dict(proxy.pool.kv_stats),
    }


ROUTES = [
    ("POST", "/executions", _register, RegisterRequest),
    ("GET", "/executions/{eid}", _info, None),
    ("POST", "/executions/{eid}/end", _end, None),
    ("PUT", "/executions/{eid}/route", _route, RouteRequest),
    ("POST", "/executions/{eid}/export", _export, ExportRequest),
    ("GET", "/quarantine", _quarantine, None),
    ("GET", "/engines", _engines, None),
    ("GET", "/kv/reroutes", _kv_reroutes, None),
    ("PUT", "/routes", _routes, RoutesRequest),
    ("POST", "/engines/drain", _drain, DrainRequest),
]
"""Every admin route: method, path under /admin, handler, and its body's model (None: it reads no body)."""


def admin_router() -> APIRouter:
    """The admin routes under /admin, for an app whose `state.proxy` is the proxy (`gyre_tito.server.create_app`):
    each request finds it there, through `admin_proxy`."""
    r = APIRouter(prefix="/admin", route_class=AdminRoute, dependencies=[Depends(admin_proxy)])
    for method, path, endpoint, model in ROUTES:
        # the body is parsed by a dependency (`_body`), which OpenAPI cannot see: its schema is declared here
        body = {"content": {"application/json": {"schema": model.model_json_schema()}}} if model else None
        r.add_api_route(path, endpoint, methods=[method], openapi_extra=body and {"requestBody": body})
    return r
