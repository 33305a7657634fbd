"""Satellite / engine side of the HTTP weight transport: pull an `HttpWeightPublisher`'s buffer with streamed GETs.

`HttpWeightSubscriber` is a `WeightSubscriber` (same `read`, `Snapshot`, `lock`, `bind`, `load_into`, errors) that
needs no system library: each attempt is one GET whose body lands directly in the subscriber's own buffer (no
staging copy), and it is kept only if the publisher's sequence number after the data equals the one before.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from gyre_cell.errors import TransferError

from .http_publisher import DATA_PATH, SEQ_HEADER, TRAILER, VERSION_HEADER
from .manifest import HEADER_BYTES, WeightManifest
from .mooncake import MooncakeConfig
from .subscriber import SubscriberConfig, WeightSubscriber

__all__ = ["HttpWeightSubscriber", "fetch_http_manifest"]


def _auth(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def fetch_http_manifest(url: str, secret: str, *, timeout_s: float = 30.0) -> WeightManifest:
    """GET an `HttpWeightPublisher`'s manifest with the run's secret."""
    try:
        resp = httpx.get(url, headers=_auth(secret), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise TransferError(f"manifest at {url}: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise TransferError(f"manifest at {url} answered {resp.status_code}: {resp.text[:200]}")
    return WeightManifest.model_validate_json(resp.content)


class HttpWeightSubscriber(WeightSubscriber):
    """Holds one buffer shaped like the publisher's and refills it on each `read` (one GET per attempt)."""

    def __init__(
        self,
        manifest: WeightManifest,
        *,
        secret: str,
        config: SubscriberConfig | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        peer = urlsplit(manifest.peer)
        if peer.scheme != "http" or not peer.hostname or peer.port is None or peer.path not in ("", "/"):
            raise TransferError(
                f"not an HTTP weight publisher: {manifest.peer!r} (expected http://HOST:PORT)"
            )
        self._host, self._port, self._secret, self._timeout_s = peer.hostname, peer.port, secret, timeout_s
        super().__init__(manifest, config=config)
        self._data = memoryview(self._buffer.numpy())[HEADER_BYTES : manifest.length]

    def _open(self, mooncake: MooncakeConfig | None) -> Any:
        return "http"  # nothing to open: each attempt makes its own connection

    def _attempt(self, after_data: Callable[[], None] | None) -> int | None:
        """One GET: the version read, or None when a write was open or overlapped it."""
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            conn.request("GET", f"{DATA_PATH}?addr={self.manifest.buffer_addr}", headers=_auth(self._secret))
            resp = conn.getresponse()
            if resp.status == 503:  # a write is open
                return None
            if resp.status != 200:
                body = resp.read(2048).decode("utf-8", "replace")
                raise TransferError(f"weights at {self.manifest.peer} answered {resp.status}: {body[:200]}")
            expected = len(self._data) + TRAILER.size
            if resp.getheader("content-length") != str(expected):
                raise TransferError(
                    f"{self.manifest.peer} sends {resp.getheader('content-length')} bytes, its manifest says "
                    f"{expected}: the publisher changed; fetch its manifest again"
                )
            seq0, version = int(resp.getheader(SEQ_HEADER, "")), int(resp.getheader(VERSION_HEADER, ""))
            _read_exactly(resp, self._data)  # straight into this subscriber's buffer
            if after_data is not None:
                after_data()
            trailer = bytearray(TRAILER.size)
            _read_exactly(resp, memoryview(trailer))
            return version if TRAILER.unpack(trailer)[0] == seq0 else None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise TransferError(
                f"pulling weights from {self.manifest.peer}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            conn.close()

    def close(self) -> None:
        self._engine = None


def _read_exactly(resp: http.client.HTTPResponse, into: memoryview) -> None:
    got = 0
    while got < len(into):
        n = resp.readinto(into[got:])
        if not n:
            raise TransferError(f"connection closed after {got} of {len(into)} bytes")
        got += n
