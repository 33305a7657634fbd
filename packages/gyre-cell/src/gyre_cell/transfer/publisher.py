"""Core side: registered flat buffers holding the authoritative weights, refreshed in place after each step.

The buffers are allocated once, registered once, and live in shared memory where the host allows it
(`gyre_cell.transfer.shm`): subscribers on other hosts pull them over Mooncake, those on this host map them. With
shared memory there are two ("slots"): each publication goes into the one not holding the newest, so an engine on
this host can serve the newest slot's pages as its parameters (`WeightStore.bind`) while the next one is written."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from ..engine.weights import all_finite
from .manifest import (
    GENERATION,
    HEADER_BYTES,
    MAGIC,
    MAGIC_SLOT,
    MAX_SLOTS,
    SEQ,
    VERSION,
    BufferSlot,
    WeightManifest,
    plan_layout,
    tensor_views,
)
from .mooncake import MooncakeConfig, open_transfer_engine, peer_address
from .shm import LeasedSlot, SharedBuffer, SharedMapping, SlotLease, map_shared

MANIFEST_PATH = "/weights/manifest"
log = logging.getLogger(__name__)
FINITE_CHUNK = 1 << 17
"""Values copied and checked at a time by `copy_finite` (512 KiB of float32: stays in L2)."""
LOCK_POLL_S = (0.001, 0.05)
"""First and longest pause between two tries of a slot's exclusive lock."""


def named_tensors(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a model's state dict or a plain mapping."""
    items = source.state_dict(keep_vars=False) if isinstance(source, torch.nn.Module) else source
    return [(n, t.detach()) for n, t in items.items()]


def copy_finite(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """`dst.copy_(src)`, and whether `dst` holds no NaN or infinity. The check sums each chunk right after copying
    it, while it is in cache (a sum is finite only if every value is: `all_finite`): 0.039 s for the copy and check
    of 52.7M float32 values, against 0.046 s for the copy then a second pass, and 0.032 s for the copy alone."""
    if (
        not dst.is_floating_point()
        or not (dst.is_contiguous() and src.is_contiguous())
        or src.shape != dst.shape
    ):
        dst.copy_(src)
        return all_finite(dst)
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    sums = [
        flat_dst[i : i + FINITE_CHUNK].copy_(flat_src[i : i + FINITE_CHUNK]).sum()
        for i in range(0, flat_dst.numel(), FINITE_CHUNK)
    ]
    if not sums or math.isfinite(float(torch.stack(sums).sum())):
        return True
    return bool(torch.isfinite(dst).all())  # a NaN or inf, or only a sum that overflowed (huge finite values)


@dataclass
class _Slot:
    buffer: torch.Tensor
    header: torch.Tensor
    views: dict[str, torch.Tensor]
    shared: SharedBuffer | None
    readonly: tuple[SharedMapping, dict[str, torch.Tensor]] | None = None
    """The slot mapped again, read-only, for an engine in this process to bind (made once, on first use)."""


class PublishedTensors(dict[str, torch.Tensor]):
    """`WeightPublisher.tensors()`: the newest publication's views; `hold()` gives an engine in this process the
    same publication as read-only views under a lease (`WeightStore.bind`), or None where it cannot (one slot in
    private memory, a write open, or the publisher has moved on since)."""

    def __init__(self, views: dict[str, torch.Tensor], hold: Callable[[], LeasedSlot | None]) -> None:
        super().__init__(views)
        self._hold = hold

    def hold(self) -> LeasedSlot | None:
        return self._hold()


class WeightPublisher:
    """Owns one or two registered buffers; `publish` copies new weights into one under a seqlock.

    The layout (names, dtypes, shapes) is fixed by the first state dict; later publishes must match it.
    Readers pull the bytes with Mooncake or map them (same host; no work on this side beyond the copy in `publish`).
    `check_finite`: `publish` refuses NaN or infinite values (checked per tensor right after its copy, while it is in
    cache), so that the engines loading it need not check again (`WeightManifest.finite_checked`).
    `shared_memory=False` keeps the buffer in private memory (Mooncake only, one slot).
    `slots`: 2 (shared memory only) lets same-host engines bind the newest publication; 1 is a single buffer.
    `lease_wait_s`: how long a write waits for an engine still serving the target slot to move on (`SlotLease`)
    before it writes anyway, revoking that engine's weights (`_lock_slot`).
    """

    def __init__(
        self,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        version: int = 0,
        config: MooncakeConfig | None = None,
        check_finite: bool = True,
        shared_memory: bool = True,
        slots: int = MAX_SLOTS,
        lease_wait_s: float = 1.0,
    ) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be 1..{MAX_SLOTS}, got {slots}")
        self.config = config or MooncakeConfig()
        self.check_finite = check_finite
        self.lease_wait_s = lease_wait_s
        named = named_tensors(source)
        self._entries, length = plan_layout(named)
        self._slots: list[_Slot] = []
        for _ in range(slots):
            shared = SharedBuffer.create(length) if shared_memory else None
            if shared is None and self._slots:
                break  # no shared memory: one private buffer, exactly as before slots existed
            buffer = shared.tensor if shared is not None else torch.zeros(length, dtype=torch.uint8)
            header = buffer[: 6 * 8].view(torch.int64)
            header[MAGIC_SLOT] = MAGIC
            self._slots.append(_Slot(buffer, header, tensor_views(buffer, self._entries), shared))
            if shared is None:
                break
        self._newest = len(self._slots) - 1  # the first publication goes into slot 0
        self._target = 0
        self._locked = False  # the target slot's exclusive lock is held (`_lock_slot`)
        self._generation = 0
        self._lock = threading.Lock()
        self._write_seq = 0
        self._http: ThreadingHTTPServer | None = None
        self._engine: Any = None
        self.peer = self._expose()
        self.publish(named, version=version)

    def _expose(self) -> str:
        """Make the buffers readable by peers; the name they reach them by (here: registered with Mooncake).
        A publisher over another transport (`HttpWeightPublisher`) overrides it."""
        self._engine = open_transfer_engine(self.config)
        for slot in self._slots:
            rc = self._engine.register_memory(slot.buffer.data_ptr(), slot.buffer.numel())
            if rc != 0:
                for done in self._slots[: self._slots.index(slot)]:
                    self._engine.unregister_memory(done.buffer.data_ptr())
                self._engine = None
                raise RuntimeError(f"Mooncake register_memory of {slot.buffer.numel()} bytes returned {rc}")
        return peer_address(self.config, self._engine)

    @property
    def _buffer(self) -> torch.Tensor:
        """The buffer holding the newest publication."""
        return self._slots[self._newest].buffer

    @property
    def _header(self) -> torch.Tensor:
        return self._slots[self._newest].header

    @property
    def version(self) -> int:
        return int(self._header[VERSION])

    @property
    def nbytes(self) -> int:
        return self._buffer.numel()

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def manifest(self) -> WeightManifest:
        return WeightManifest(
            peer=self.peer,
            slots=[
                BufferSlot(addr=s.buffer.data_ptr(), shm=s.shared.ref if s.shared is not None else None)
                for s in self._slots
            ],
            length=self._buffer.numel(),
            version=self.version,
            tensors=self._entries,
            finite_checked=self.check_finite,
        )

    def tensors(self) -> PublishedTensors:
        """Views of the newest publication (read them only between writes: with one slot, the next write
        overwrites them; with two, the one after it)."""
        i = self._newest
        generation = int(self._slots[i].header[GENERATION])
        return PublishedTensors(self._slots[i].views, lambda: self._hold(i, generation))

    def _hold(self, i: int, generation: int) -> LeasedSlot | None:
        """Slot `i` as read-only views under a lease, if it still holds publication `generation`."""
        slot = self._slots[i]
        if slot.shared is None:
            return None
        if slot.readonly is None:
            mapping = map_shared(slot.shared.ref, slot.buffer.numel())
            if mapping is None:
                return None
            slot.readonly = mapping, tensor_views(mapping.tensor, self._entries)
        mapping, views = slot.readonly
        lease = SlotLease.take(slot.shared.ref.path, mapping.identity)
        if lease is None:  # a write into it is open
            return None
        seq, version = int(slot.header[SEQ]), int(slot.header[VERSION])
        if seq % 2 or int(slot.header[GENERATION]) != generation:  # written since `tensors()`, or aborted
            lease.release()
            return None
        lease.watch(mapping.tensor[:HEADER_BYTES].view(torch.int64), seq)
        start = mapping.tensor.data_ptr()
        return LeasedSlot(version, views, lease, (start, start + mapping.tensor.numel()))

    def begin_write(self) -> dict[str, torch.Tensor]:
        """Open a write into the slot not holding the newest publication and return its tensor views; readers of
        that slot retry until `end_write` (readers of the other one are untouched).

        The sequence number stays odd while a write is open, so a reader that saw any byte of a partial write
        sees a different sequence number afterwards. On x86 (TSO) stores become visible in program order.
        An engine still serving the target slot after `lease_wait_s` has its weights revoked (`_lock_slot`).
        """
        self._lock.acquire()
        try:
            self._target = (self._newest + 1) % len(self._slots)
            self._lock_slot(self._slots[self._target])
        except BaseException:
            self._lock.release()
            raise
        header = self._slots[self._target].header
        seq = int(header[SEQ])
        self._write_seq = seq + (seq & 1)  # an aborted write left it odd
        header[SEQ] = self._write_seq + 1
        return self._slots[self._target].views

    def _lock_slot(self, slot: _Slot) -> None:
        """The slot's exclusive lock (shared memory only): no engine serves its pages any more. An engine that
        still does after `lease_wait_s` missed a publication (a failed load, a hung process): the write goes ahead
        without the lock, and that engine finds its lease broken after its next step (`SlotLease.intact`) and
        serves nothing until it loads again, rather than every later publication stopping for it."""
        self._locked = False
        if slot.shared is None:
            return
        deadline = time.monotonic() + self.lease_wait_s
        pause = LOCK_POLL_S[0]
        while not slot.shared.lock_exclusive():
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "an engine still serves version %d from the slot this publication overwrites (%s): it missed "
                    "a publication; its weights are revoked until it loads again",
                    int(slot.header[VERSION]),
                    slot.shared.ref.path,
                )
                return
            time.sleep(min(pause, left))
            pause = min(pause * 2, LOCK_POLL_S[1])
        self._locked = True

    def _unlock_slot(self) -> None:
        shared = self._slots[self._target].shared
        if shared is not None and self._locked:
            shared.unlock()
            self._locked = False

    def end_write(self, version: int) -> None:
        """Close the open write: its slot now holds `version`, the newest publication. A version the header cannot
        hold (outside int64) aborts the write instead: the locks are released either way, so one bad version never
        blocks later writes."""
        slot = self._slots[self._target]
        try:
            slot.header[VERSION] = version
        except (OverflowError, ValueError, RuntimeError, TypeError):  # torch: ValueError (overflow)
            self.abort_write()
            raise ValueError(f"version {version!r} does not fit the buffer's int64 header") from None
        self._generation += 1
        slot.header[GENERATION] = self._generation
        slot.header[SEQ] = self._write_seq + 2
        self._newest = self._target
        self._unlock_slot()
        self._lock.release()

    def abort_write(self) -> None:
        """Give up an open write: its slot's sequence stays odd, readers never accept the partial bytes (with two
        slots they read the newest publication from the other one)."""
        self._unlock_slot()
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
        unknown = [n for n in given if n not in self._slots[0].views]
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
                if not self.check_finite:
                    view.copy_(t)
                elif not copy_finite(view, t):
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
            for slot in self._slots:
                self._engine.unregister_memory(slot.buffer.data_ptr())
            self._engine = None  # dropping the last reference stops Mooncake's threads and closes its ports
        for slot in self._slots:
            if slot.shared is not None:
                slot.shared.close()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
