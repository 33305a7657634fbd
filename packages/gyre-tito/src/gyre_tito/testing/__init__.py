"""Helpers to run the proxy and scripted engines on loopback in-process (tests, benchmarks, demos).

`ProxyServer(config)` serves `create_app(Proxy(config))` with uvicorn in a background thread:
`with ProxyServer(cfg) as srv: srv.url, srv.proxy, srv.register() -> (execution_id, credential)`.
"""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from gyre_tito.proxy import Proxy, ProxyConfig
from gyre_tito.server import create_app

__all__ = ["ProxyServer"]


class ProxyServer:
    def __init__(self, config: ProxyConfig):
        self.config = config
        self.proxy = Proxy(config)
        self.app = create_app(self.proxy)
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, port: int = 0) -> str:
        cfg = uvicorn.Config(
            self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", timeout_keep_alive=75
        )
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 20
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("proxy did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self._server.servers[0].sockets[0].getsockname()[1]}"
        return self.url

    def admin(self, method: str, path: str, json=None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.config.admin_token}"}
        return httpx.request(method, self.url + path, json=json, headers=headers, timeout=60)

    def register(self, execution_id: str | None = None, **kw) -> tuple[str, str]:
        body = {"execution_id": execution_id, **kw} if execution_id else dict(kw)
        r = self.admin("POST", "/admin/executions", body)
        r.raise_for_status()
        return r.json()["execution_id"], r.json()["credential"]

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._server = None
        self.proxy.records.close()

    def __enter__(self) -> ProxyServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
