"""Core side of the HTTP weight transport: the Mooncake publisher's buffer and seqlock, served over plain HTTP.

Where Mooncake cannot load (no `libibverbs.so.1`, no RDMA) the core still publishes into one flat buffer laid out as
`manifest.py` describes and refreshed in place under the same seqlock; subscribers pull it with one streamed GET
per attempt instead of RDMA/TCP reads. Nothing beyond the buffer is held: the body is written from the buffer's
memory as it is, and the reader checks the sequence number sent before the data against the one sent after it.

Endpoints (every one needs `Authorization: Bearer <run secret>`; anything else is a 4xx, never a 5xx):
- `GET /weights/manifest`: the `WeightManifest` (peer = this server's base URL, one slot whose addr is the buffer's id).
- `GET /weights/data?addr=A`: 200 with headers `x-gyre-seq`, `x-gyre-version` and a body of the buffer's data
  region (`length - HEADER_BYTES` bytes) followed by the 8-byte little-endian sequence number read after it; 503
  while a write is open; 409 when `addr` is not this buffer (a manifest of another publisher).
"""

from __future__ import annotations

import hmac
import json
import struct
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch

from .manifest import HEADER_BYTES, SEQ, VERSION, WeightManifest
from .publisher import MANIFEST_PATH, WeightPublisher

__all__ = ["DATA_PATH", "HttpWeightPublisher"]

DATA_PATH = "/weights/data"
SEQ_HEADER, VERSION_HEADER = "x-gyre-seq", "x-gyre-version"
TRAILER = struct.Struct("<q")
CHUNK = 4 << 20


class HttpWeightPublisher(WeightPublisher):
    """A `WeightPublisher` (same layout, seqlock, `publish`, `writing`, `tensors`) whose buffer is read over HTTP.

    `serve_manifest(host, port)` starts the one server (manifest and data) and returns the manifest's URL; the
    manifest exists from then on. `secret` is the run's token: every request must carry it.
    """

    def __init__(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        version: int = 0,
        secret: str,
        check_finite: bool = True,
    ) -> None:
        if not secret:
            raise ValueError("the HTTP weight transport needs the run's secret (the engine token)")
        self._secret = secret.encode()
        self.after_send: Callable[[], None] | None = None
        """Test gate: runs in the serving thread between the data and the closing sequence number."""
        # its readers pull over HTTP: no shared memory
        super().__init__(source, version=version, check_finite=check_finite, shared_memory=False)

    def _expose(self) -> str:
        """Nothing to register: peers reach the buffer through `serve_manifest`, which names it."""
        return ""

    def manifest(self) -> WeightManifest:
        if not self.peer:
            raise RuntimeError("not served yet: call serve_manifest(host) first")
        return super().manifest()

    def serve_manifest(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve the manifest and the data from a daemon thread on `host` (the address peers reach); its URL."""
        if self._http is not None:
            raise RuntimeError("weight server already running")
        server = _Server((host, port), _Handler)
        server.publisher = self
        self._http = server
        # close() waits at most one poll interval
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="weight-http"
        ).start()
        name = f"[{host}]" if ":" in host else host
        self.peer = f"http://{name}:{server.server_address[1]}"
        return self.peer + MANIFEST_PATH

    # ---- serving (called from the server's threads) ---------------------------------------------------------
    def _authorized(self, header: str | None) -> bool:
        given = header[7:].strip().encode() if header and header[:7].lower() == "bearer " else b""
        return hmac.compare_digest(given, self._secret)

    def _stream(self, handler: _Handler) -> None:
        """One attempt of a consistent read: the data region as it is now, then the sequence number after it."""
        seq, held = int(self._header[SEQ]), int(self._header[VERSION])
        if seq % 2:
            return handler.reply(503, "a publication is being written; try again")
        data = memoryview(self._buffer.numpy())[HEADER_BYTES:]
        handler.send_response(200)
        handler.send_header("content-type", "application/octet-stream")
        handler.send_header("content-length", str(len(data) + TRAILER.size))
        handler.send_header(SEQ_HEADER, str(seq))
        handler.send_header(VERSION_HEADER, str(held))
        handler.end_headers()
        for offset in range(0, len(data), CHUNK):
            handler.wfile.write(data[offset : offset + CHUNK])  # from the buffer itself: no copy
        if self.after_send is not None:
            self.after_send()
        handler.wfile.write(TRAILER.pack(int(self._header[SEQ])))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    publisher: HttpWeightPublisher

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that hangs up mid-body is its own problem: no traceback on the publisher's stderr."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 120  # a peer that stops reading frees its thread
    default_request_version = "HTTP/1.0"  # a malformed request line gets a status line (400), not HTTP/0.9

    def do_GET(self) -> None:
        pub = self.server.publisher
        if not pub._authorized(self.headers.get("authorization")):
            return self.reply(401, "missing or wrong run secret (Authorization: Bearer ...)")
        url = urlsplit(self.path)
        if url.path == MANIFEST_PATH and not url.query:
            return self.reply(200, pub.manifest().model_dump_json().encode())
        if url.path != DATA_PATH:
            return self.reply(404, f"not found: GET {MANIFEST_PATH} or {DATA_PATH}")
        try:
            query = parse_qs(url.query, strict_parsing=True) if url.query else {}
        except ValueError:
            return self.reply(400, "malformed query string")
        addr = query.get("addr", [])
        if set(query) != {"addr"} or len(addr) != 1 or not (addr[0].isascii() and addr[0].isdigit()):
            return self.reply(400, "the query is addr=<the manifest's buffer_addr>, once")
        if addr[0] != str(pub._buffer.data_ptr()):  # compared as text: no huge int is ever parsed
            return self.reply(409, f"no weight buffer at address {addr[0][:40]}: fetch the manifest again")
        try:
            pub._stream(self)
        except OSError:  # the peer hung up: nothing to answer
            self.close_connection = True

    def __getattr__(self, name: str) -> Any:
        """Any other method (`do_POST`, `do_HEAD`, ...) is a 405 (the base class answers 501 otherwise)."""
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self.reply(405, f"{self.command} is not allowed: GET only", {"allow": "GET"})

    def reply(self, status: int, body: bytes | str, headers: Mapping[str, str] | None = None) -> None:
        if isinstance(body, str):
            body = json.dumps({"error": {"message": body}}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # one line per pull would flood the cell's log
        pass
