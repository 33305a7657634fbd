"""The live dashboard's HTTP server: a read-only view of a run directory, served from inside the run's process.

Routes (GET only; any other method is refused with 405):
- `/`: the page (static/index.html with the stylesheet and scripts linked), `/static/NAME`: its assets, among them the
  vendored Chart.js (no network at run time);
- `/api/state`: summary, series and the executions table in one object (what the page polls every `refresh_s`);
- `/api/summary`, `/api/series`, `/api/executions`: the same parts alone;
- `/api/execution/{id}`: one execution's trajectory tree, selected trajectories and assessments (404 if unknown).

Access: on a loopback address anyone on this machine may read it (requests must name a loopback host, so a web page
cannot reach it through DNS rebinding). On any other address a token is required: as
`?token=...` (the page then gets an HttpOnly cookie, so its own requests carry it), an `Authorization: Bearer` header or
that cookie; anything else is 401. `DashboardServer.url` includes the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
import socket
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from gyre.observe.rundata import RunView

__all__ = ["STATIC", "DashboardServer", "is_loopback", "make_app", "page"]

STATIC = Path(__file__).parent / "static"
ASSETS = {
    "chart.umd.min.js": "text/javascript",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "chart.js-LICENSE.md": "text/plain",
}
COOKIE = "gyre_dashboard"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def openable_host(host: str) -> str:
    """The address a user can open for a server bound to ``host``: ``host`` itself, unless it is the wildcard
    (``0.0.0.0``, ``::``), which no browser can open: then this machine's address, the one its host name resolves to
    or else the one its default route leaves from (a UDP socket's connect sends nothing), loopback as the last
    resort."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a host name: the user's resolver knows it
        return host
    if not ip.is_unspecified:
        return host
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with contextlib.suppress(OSError):
        for *_, address in socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM):
            if not ipaddress.ip_address(address[0]).is_loopback:
                return address[0]
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(("2001:db8::1" if ip.version == 6 else "192.0.2.1", 9))  # documentation addresses
        return probe.getsockname()[0]
    return "::1" if ip.version == 6 else "127.0.0.1"


def _loopback_host(host_header: str) -> bool:
    host = host_header.strip()
    if host.startswith("["):  # [::1]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return is_loopback(host)


def page(head: str, scripts: str, refresh_s: float, mode: str) -> str:
    """static/index.html with its head and scripts filled in (linked here, inlined by the static report)."""
    html = (STATIC / "index.html").read_text()
    html = html.replace('data-refresh-s="1"', f'data-refresh-s="{refresh_s:g}"', 1)
    html = html.replace('data-mode="live"', f'data-mode="{mode}"', 1)
    # the placeholders last: nothing in the inlined scripts and data is searched or replaced
    return html.replace("<!--HEAD-->", head, 1).replace("<!--SCRIPTS-->", scripts, 1)


class _Cached:
    """Refreshes the view at most every `min_s` (many tabs polling read the files once)."""

    def __init__(self, view: RunView, min_s: float = 0.25) -> None:
        self.view, self.min_s, self._at = view, min_s, 0.0
        self._lock = asyncio.Lock()

    async def fresh(self) -> RunView:
        async with self._lock:
            if time.monotonic() - self._at >= self.min_s:
                await asyncio.to_thread(self.view.refresh)
                self._at = time.monotonic()
        return self.view


def make_app(view: RunView, token: str | None = None, refresh_s: float = 1.0) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    cache = _Cached(view)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        set_cookie = False
        if token is None and not _loopback_host(request.headers.get("host", "")):
            # served on loopback without a token: refuse other Host names (DNS rebinding from a web page)
            return JSONResponse({"error": "this dashboard answers on its loopback address only"}, 421)
        if token is not None:
            given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
            auth = request.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if not secrets.compare_digest(given.encode(), token.encode()):
                return JSONResponse({"error": "a token is required: open the URL the run printed"}, 401)
            set_cookie = "token" in request.query_params
        if request.method not in ("GET", "HEAD"):
            return JSONResponse({"error": "the dashboard is read-only"}, 405, headers={"Allow": "GET, HEAD"})
        response: Response = await call_next(request)
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'"
        )
        if set_cookie:
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    linked_head = '<link rel="stylesheet" href="static/dashboard.css">'
    linked_scripts = (
        '<script src="static/chart.umd.min.js"></script><script src="static/dashboard.js"></script>'
    )

    @app.get("/")
    async def index() -> HTMLResponse:
        return HTMLResponse(page(linked_head, linked_scripts, refresh_s, "live"))

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in ASSETS:
            return JSONResponse({"error": "not found"}, 404)
        return FileResponse(STATIC / name, media_type=ASSETS[name])

    @app.get("/api/state")
    async def state() -> JSONResponse:
        v = await cache.fresh()
        return JSONResponse({"summary": v.summary(), "series": v.series(), "executions": v.executions()})

    @app.get("/api/summary")
    async def summary() -> JSONResponse:
        return JSONResponse((await cache.fresh()).summary())

    @app.get("/api/series")
    async def series() -> JSONResponse:
        return JSONResponse((await cache.fresh()).series())

    @app.get("/api/executions")
    async def executions() -> JSONResponse:
        return JSONResponse((await cache.fresh()).executions())

    @app.get("/api/execution/{execution_id}")
    async def execution(execution_id: str) -> JSONResponse:
        detail = await asyncio.to_thread(view.execution, execution_id)
        if detail is None:
            return JSONResponse({"error": f"no execution {execution_id!r} in this run"}, 404)
        return JSONResponse(detail)

    return app


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the run's own SIGINT/SIGTERM handlers (gyre.cli) stop everything
        yield


class DashboardServer:
    """Serves `make_app` on the running event loop: `await start()`, `url`, `await stop()`."""

    def __init__(
        self,
        view: RunView,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        refresh_s: float = 1.0,
    ) -> None:
        if token is None and not is_loopback(host):
            token = secrets.token_urlsafe(18)
        self.host, self.token = host, token
        app = make_app(view, token, refresh_s)
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", access_log=False
        )
        self._server = _Server(config)
        self._task: asyncio.Task | None = None
        self.port = port

    @property
    def url(self) -> str:
        host = openable_host(self.host)  # bound to every interface: print one a user can open
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/" + (f"?token={self.token}" if self.token else "")

    async def start(self, timeout_s: float = 30.0) -> str:
        self._task = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it (e.g. the port is taken)
                raise RuntimeError("the dashboard server stopped before it started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard server did not start within {timeout_s:.0f} s")
            await asyncio.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.url

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._task, timeout=5.0)
        if not self._task.done():
            self._task.cancel()
        self._task = None
