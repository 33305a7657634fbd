"""Core side: a registered flat buffer holding the authoritative weights, refreshed in place after each step.

The buffer is allocated once, registered once, and lives in shared memory where the host allows it
(`gyre_cell.transfer.shm`): subscribers on other hosts pull it over Mooncake, those on this host map it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from ..engine.weights import all_finite
from .manifest import MAGIC, MAGIC_SLOT, SEQ, VERSION, WeightManifest, plan_layout, tensor_views
from .mooncake import MooncakeConfig, open_transfer_engine, peer_address
from .shm import SharedBuffer

MANIFEST_PATH = "/weights/manifest"


def named_tensors(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a model's state dict or a plain mapping."""
    items = source.state_dict(keep_vars=False) if isinstance(source, torch.nn.Module) else source
    return [(n, t.detach()) for n, t in items.items()]


class WeightPublisher:
    """Owns one registered buffer; `publish` copies new weights into it under a seqlock.

    The layout (names, dtypes, shapes) is fixed by the first state dict; later publishes must match it.
    Readers pull the bytes with Mooncake or map them (same host; no work on this side beyond the copy in `publish`).
    `check_finite`: `publish` refuses NaN or infinite values (checked per tensor right after its copy, while it is in
    cache), so that the engines loading it need not check again (`WeightManifest.finite_checked`).
    `shared_memory=False` keeps the buffer in private memory (Mooncake only).
    """

    def __init__(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        version: int = 0,
        config: MooncakeConfig | None = None,
        check_finite: bool = True,
        shared_memory: bool = True,
    ) -> None:
        self.config = config or MooncakeConfig()
        self.check_finite = check_finite
        named = named_tensors(source)
        self._entries, length = plan_layout(named)
        self._shared = SharedBuffer.create(length) if shared_memory else None
        self._buffer = (
            self._shared.tensor if self._shared is not None else torch.zeros(length, dtype=torch.uint8)
        )
        self._header = self._buffer[: 3 * 8].view(torch.int64)
        self._views = tensor_views(self._buffer, self._entries)
        self._lock = threading.Lock()
        self._write_seq = 0
        self._http: ThreadingHTTPServer | None = None
        self._engine: Any = None
        self.peer = self._expose()
        self._header[MAGIC_SLOT] = MAGIC
        self.publish(named, version=version)

    def _expose(self) -> str:
        """Make the buffer readable by peers; the name they reach it by (here: registered with Mooncake).
        A publisher over another transport (`HttpWeightPublisher`) overrides it."""
        length = self._buffer.numel()
        self._engine = open_transfer_engine(self.config)
        rc = self._engine.register_memory(self._buffer.data_ptr(), length)
        if rc != 0:
            self._engine = None
            raise RuntimeError(f"Mooncake register_memory of {length} bytes returned {rc}")
        return peer_address(self.config, self._engine)

    @property
    def version(self) -> int:
        return int(self._header[VERSION])

    @property
    def nbytes(self) -> int:
        return self._buffer.numel()

    def manifest(self) -> WeightManifest:
        return WeightManifest(
            peer=self.peer,
            buffer_addr=self._buffer.data_ptr(),
            length=self._buffer.numel(),
            version=self.version,
            tensors=self._entries,
            shm=self._shared.ref if self._shared is not None else None,
            finite_checked=self.check_finite,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Views of the published tensors (read them only between writes)."""
        return dict(self._views)

    def begin_write(self) -> dict[str, torch.Tensor]:
        """Open a write and return the buffer's tensor views; readers retry until `end_write`.

        The sequence number stays odd while a write is open, so a reader that saw any byte of a partial write
        sees a different sequence number afterwards. On x86 (TSO) stores become visible in program order.
        """
        self._lock.acquire()
        seq = int(self._header[SEQ])
        self._write_seq = seq + (seq & 1)  # an aborted write left it odd
        self._header[SEQ] = self._write_seq + 1
        return self._views

    def end_write(self, version: int) -> None:
        """Close the open write: the buffer now holds `version`. A version the header cannot hold (outside int64)
        aborts the write instead: the lock is released either way, so one bad version never blocks later writes."""
        try:
            self._header[VERSION] = version
        except (OverflowError, ValueError, RuntimeError, TypeError):  # torch: ValueError (overflow)
            self.abort_write()
            raise ValueError(f"version {version!r} does not fit the buffer's int64 header") from None
        self._header[SEQ] = self._write_seq + 2
        self._lock.release()

    def abort_write(self) -> None:
        """Give up an open write: the sequence stays odd, readers never accept the partial bytes."""
        self._lock.release()

    @contextlib.contextmanager
    def writing(self, version: int) -> Iterator[dict[str, torch.Tensor]]:
        """`begin_write` ... `end_write(version)` as a block; an exception aborts the write."""
        views = self.begin_write()
        try:
            yield views
        except BaseException:
            self.abort_write()
            raise
        self.end_write(version)

    def publish(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
    ) -> None:
        """Copy every tensor of `source` into the buffer (all names of the layout must be present). With
        `check_finite`, a NaN or infinite value raises ValueError and aborts the write: readers get no snapshot
        until the next publish (they retry, then fail as on any torn write), never the bad one."""
        named = named_tensors(source) if isinstance(source, torch.nn.Module | Mapping) else list(source)
        given = dict(named)
        missing = [e.name for e in self._entries if e.name not in given]
        unknown = [n for n in given if n not in self._views]
        if missing or unknown:
            raise ValueError(
                f"publish does not match the layout: missing {missing[:5]}, unknown {unknown[:5]}"
            )
        for e in self._entries:
            if list(given[e.name].shape) != e.shape:
                raise ValueError(f"{e.name}: shape {list(given[e.name].shape)} != layout {e.shape}")
        with torch.no_grad(), self.writing(version) as views:
            for name, t in given.items():
                view = views[name]
                view.copy_(t)
                if self.check_finite and not all_finite(view):
                    raise ValueError(f"{name}: NaN or infinite values; not published")

    # ---- handshake over HTTP -----------------------------------------------------------------
    def serve_manifest(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve `GET /weights/manifest` (JSON) from a daemon thread; returns its URL."""
        if self._http is not None:
            raise RuntimeError("manifest server already running")
        publisher = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != MANIFEST_PATH:
                    body, status = b'{"error": {"message": "not found: GET /weights/manifest"}}', 404
                else:
                    body, status = publisher.manifest().model_dump_json().encode(), 200
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # keep test and bench output clean
                pass

        self._http = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True, name="weight-manifest").start()
        return f"http://{host}:{self._http.server_address[1]}{MANIFEST_PATH}"

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._engine is not None:
            self._engine.unregister_memory(self._buffer.data_ptr())
            self._engine = None  # dropping the last reference stops Mooncake's threads and closes its ports
        if self._shared is not None:
            self._shared.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
