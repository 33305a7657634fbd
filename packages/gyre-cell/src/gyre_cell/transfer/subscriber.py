"""Satellite / engine side: pull the publisher's whole buffer with Mooncake and load it into a torch model.

On the publisher's host the subscriber maps its buffers instead (`gyre_cell.transfer.shm`; `SubscriberConfig.
shared_memory`): `read` copies the mapped bytes into the subscriber's buffer under the same seqlock,
`read_apply` hands the mapped tensors straight to a loader (one copy, into the model's parameters), and
`lease_newest` holds the newest slot in place for an engine that serves it as its parameters (no copy)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from pydantic import BaseModel, ConfigDict

from gyre_cell.errors import TornSnapshotError, TransferError, TransferTimeoutError

from .manifest import (
    GENERATION,
    HEADER_BYTES,
    MAGIC,
    MAGIC_SLOT,
    SEQ,
    VERSION,
    WeightManifest,
    tensor_views,
)
from .mooncake import MooncakeConfig, open_transfer_engine, read_pieces
from .shm import LeasedSlot, SharedMapping, SlotLease, map_shared


class SubscriberConfig(BaseModel):
    """How a subscriber reads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket_bytes: int = 32 << 20
    """Size of one piece of a Mooncake read (the pieces move concurrently: `mooncake.read_pieces`)."""
    read_timeout_s: float = 120.0
    """A Mooncake read still running after this raises TransferTimeoutError and closes the subscriber."""
    max_attempts: int = 50
    """Reads tried before giving up on a publisher that keeps writing."""
    retry_backoff_s: float = 0.01
    """Sleep before retrying a read that overlapped a write (doubles, capped at 0.5 s)."""
    shared_memory: bool = True
    """Map the publisher's buffer when it is on this host (False: Mooncake always)."""


@dataclass(frozen=True)
class Snapshot:
    """One consistent read: `tensors` are views into the subscriber's buffer, valid until its next read."""

    version: int
    tensors: dict[str, torch.Tensor] = field(repr=False)
    attempts: int
    seconds: float
    nbytes: int


def fetch_manifest(url: str, *, timeout_s: float = 10.0) -> WeightManifest:
    """GET a publisher's manifest (`WeightPublisher.serve_manifest`)."""
    resp = httpx.get(url, timeout=timeout_s)
    if resp.status_code != 200:
        raise TransferError(f"manifest at {url} answered {resp.status_code}: {resp.text[:200]}")
    return WeightManifest.model_validate_json(resp.content)


class WeightSubscriber:
    """Holds a registered buffer shaped like the publisher's and refills it on each `read` from the publisher's
    newest slot (the one with the highest generation among those not being written)."""

    def __init__(
        self,
        manifest: WeightManifest,
        *,
        config: SubscriberConfig | None = None,
        mooncake: MooncakeConfig | None = None,
    ) -> None:
        self.manifest = manifest
        self.config = config or SubscriberConfig()
        n = len(manifest.slots)
        # Data region laid out like the publisher's, then private header slots: one per publisher slot, one after.
        self._buffer = torch.zeros(manifest.length + (n + 1) * HEADER_BYTES, dtype=torch.uint8)
        self._before = self._buffer[manifest.length : manifest.length + n * HEADER_BYTES]
        self._after = self._buffer[manifest.length + n * HEADER_BYTES :]
        self._views = tensor_views(self._buffer, manifest.tensors)
        self.lock = threading.Lock()
        """Held by callers that use a snapshot's views after `read` returns (the next read refills them)."""
        self._mappings: list[SharedMapping] = []
        self._shared_views: list[dict[str, torch.Tensor]] = []
        self._engine: Any = self._open(mooncake)

    @property
    def shared(self) -> bool:
        """The publisher's buffers are mapped here (same host): `read_apply` reads them in place."""
        return bool(self._mappings)

    def _open(self, mooncake: MooncakeConfig | None) -> Any:
        """What reads the publisher's buffers (here: their mappings on the same host, else a Mooncake engine with
        this buffer registered); None once closed. A subscriber over another transport (`HttpWeightSubscriber`)
        overrides it and `_attempt`."""
        if self.config.shared_memory and self.manifest.shared:
            mappings = [map_shared(s.shm, self.manifest.length) for s in self.manifest.slots if s.shm]
            if all(m is not None for m in mappings):
                self._mappings = mappings  # type: ignore[assignment]
                self._shared_views = [tensor_views(m.tensor, self.manifest.tensors) for m in self._mappings]
                return "shm"
        engine = open_transfer_engine(mooncake)
        rc = engine.register_memory(self._buffer.data_ptr(), self._buffer.numel())
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {self._buffer.numel()} bytes returned {rc}")
        return engine

    # ---- reading -----------------------------------------------------------------------------
    def _header(self, dst: torch.Tensor, i: int) -> tuple[int, int, int]:
        h = dst[i * HEADER_BYTES : i * HEADER_BYTES + 48].view(torch.int64)
        if int(h[MAGIC_SLOT]) != MAGIC:
            raise TransferError(
                f"no weight buffer at {self.manifest.slots[i].addr:#x} on {self.manifest.peer}"
            )
        return int(h[SEQ]), int(h[VERSION]), int(h[GENERATION])

    def _read_headers(self, slots: list[int], dst: torch.Tensor) -> list[tuple[int, int, int]]:
        """(seq, version, generation) of each of `slots`, copied into `dst` (one header each)."""
        if self._mappings:
            for k, i in enumerate(slots):
                if not self._mappings[
                    i
                ].alive():  # its pages stay mapped here: they would read as the last one
                    raise TransferError(
                        f"the publisher {self.manifest.peer} is gone (its shared buffer was closed)"
                    )
                dst[k * HEADER_BYTES : (k + 1) * HEADER_BYTES].copy_(self._mappings[i].tensor[:HEADER_BYTES])
        else:
            base = dst.data_ptr()
            rc = self._engine.batch_transfer_sync_read(
                self.manifest.peer,
                [base + k * HEADER_BYTES for k in range(len(slots))],
                [self.manifest.slots[i].addr for i in slots],
                [HEADER_BYTES] * len(slots),
            )
            if rc != 0:
                raise TransferError(f"reading the header from {self.manifest.peer} failed (rc {rc})")
        return [self._header(dst, k) for k in range(len(slots))]

    def _newest(self) -> tuple[int, int, int] | None:
        """(slot, seq, version) of the newest stable publication, or None while none is (a write open on the only
        slot, or on both)."""
        heads = self._read_headers(list(range(len(self.manifest.slots))), self._before)
        stable = [
            (gen, i, seq, version) for i, (seq, version, gen) in enumerate(heads) if seq % 2 == 0 and gen
        ]
        if not stable:
            return None
        _, i, seq, version = max(stable)
        return i, seq, version

    def _seq_now(self, slot: int) -> int:
        return self._read_headers([slot], self._after)[0][0]

    def _read_data(self, slot: int) -> None:
        end = self.manifest.length
        if self._mappings:
            self._buffer[HEADER_BYTES:end].copy_(self._mappings[slot].tensor[HEADER_BYTES:end])
            return
        base_local = self._buffer.data_ptr()
        base_peer = self.manifest.slots[slot].addr
        bucket = self.config.bucket_bytes
        offsets = range(HEADER_BYTES, end, bucket)
        lengths = [min(bucket, end - o) for o in offsets]
        try:
            read_pieces(
                self._engine,
                self.manifest.peer,
                [base_local + o for o in offsets],
                [base_peer + o for o in offsets],
                lengths,
                timeout_s=self.config.read_timeout_s,
            )
        except TransferTimeoutError:
            self.close()  # pieces still running may write into the buffer later: nothing may read it again
            raise

    def read(self, *, after_data: Callable[[], None] | None = None) -> Snapshot:
        """Pull a consistent snapshot (seqlock: header, data, header; retry if a write overlapped).

        `after_data` runs between the data read and the closing header read (tests and tracing use it).
        """
        self._check_open()
        t0 = time.perf_counter()
        backoff = self.config.retry_backoff_s
        for attempt in range(1, self.config.max_attempts + 1):
            version = self._attempt(after_data)
            if version is not None:
                return Snapshot(
                    version=version,
                    tensors=self._views,
                    attempts=attempt,
                    seconds=time.perf_counter() - t0,
                    nbytes=self.manifest.data_bytes,
                )
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.5)
        raise TornSnapshotError(
            f"no consistent snapshot from {self.manifest.peer} in {self.config.max_attempts} attempts: "
            "the publisher is writing continuously or a write failed midway"
        )

    def _check_open(self) -> None:
        if self._engine is None:
            raise TransferError("subscriber is closed")

    def read_apply(
        self,
        apply: Callable[[dict[str, torch.Tensor], int], None],
        *,
        after_data: Callable[[], None] | None = None,
    ) -> int:
        """Run `apply(tensors, version)` on a consistent snapshot; its version.

        Mapped publisher (`shared`): `apply` gets the publisher's own tensors of its newest slot (no copy here)
        between the two header reads, and runs again when a write overlapped it, so what it wrote last is one
        publication: the caller keeps its target out of use until this returns. Otherwise `apply` gets the views
        of a `read`. `after_data` runs after each `apply` (tests)."""
        self._check_open()
        if not self._mappings:
            snap = self.read(after_data=after_data)
            apply(snap.tensors, snap.version)
            return snap.version
        backoff = self.config.retry_backoff_s
        for _ in range(self.config.max_attempts):
            newest = self._newest()
            if newest is not None:
                slot, seq0, version = newest
                apply(self._shared_views[slot], version)
                if after_data is not None:
                    after_data()
                if self._seq_now(slot) == seq0:
                    return version
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.5)
        raise TornSnapshotError(
            f"no consistent snapshot of the shared buffer of {self.manifest.peer} in {self.config.max_attempts} "
            "attempts: the publisher is writing continuously or a write failed midway"
        )

    def lease_newest(self) -> LeasedSlot:
        """Hold the newest publication in place (mapped publisher only): its slot's shared lock, taken between two
        reads of its header that agree, so the views hold exactly that publication until the lease goes."""
        self._check_open()
        if not self._mappings:
            raise TransferError("lease_newest needs the publisher's buffers mapped (same host)")
        backoff = self.config.retry_backoff_s
        for _ in range(self.config.max_attempts):
            newest = self._newest()
            if newest is not None:
                slot, seq0, version = newest
                mapping = self._mappings[slot]
                lease = SlotLease.take(mapping.path, mapping.identity)
                if lease is not None:
                    if self._seq_now(slot) == seq0:
                        lease.watch(mapping.tensor[:HEADER_BYTES].view(torch.int64), seq0)
                        start = mapping.tensor.data_ptr()
                        return LeasedSlot(
                            version, self._shared_views[slot], lease, (start, start + mapping.tensor.numel())
                        )
                    lease.release()
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.5)
        raise TornSnapshotError(
            f"no stable slot of {self.manifest.peer} to hold in {self.config.max_attempts} attempts: the publisher "
            "is writing continuously or a write failed midway"
        )

    def _attempt(self, after_data: Callable[[], None] | None) -> int | None:
        """One seqlock read: the version read, or None when a write was open or overlapped it."""
        newest = self._newest()
        if newest is None:
            return None
        slot, seq0, version = newest
        self._read_data(slot)
        if after_data is not None:
            after_data()
        return version if self._seq_now(slot) == seq0 else None

    def load_into(self, model: torch.nn.Module, snapshot: Snapshot, *, strict: bool = True) -> None:
        """Copy a snapshot into `model`'s parameters and buffers (one copy; views, no staging tensors)."""
        model.load_state_dict(snapshot.tensors, strict=strict)

    def bind(self, model: torch.nn.Module) -> None:
        """Make `model`'s parameters and buffers views of this subscriber's buffer (zero copies).

        Every later `read` then lands directly in the model: use it where the model is not in use during a read
        (a satellite pulls between batches). A read that ends in an error leaves the model's values undefined.
        """
        state = model.state_dict(keep_vars=True)
        missing = sorted(set(state) - set(self._views))
        unknown = sorted(set(self._views) - set(state))
        if missing or unknown:
            raise ValueError(
                f"model does not match the manifest: missing {missing[:5]}, unknown {unknown[:5]}"
            )
        for name, t in state.items():
            view = self._views[name]
            if t.shape != view.shape or t.dtype != view.dtype:
                raise ValueError(
                    f"{name}: model has {t.dtype}{list(t.shape)}, manifest {view.dtype}{list(view.shape)}"
                )
        for name, t in state.items():
            t.data = self._views[name]

    def close(self) -> None:
        if self._mappings:  # a mapping goes with the last view of it (an engine bound to a slot keeps it)
            self._mappings, self._shared_views, self._engine = [], [], None
        if self._engine is not None:
            self._engine.unregister_memory(self._buffer.data_ptr())
            self._engine = None  # dropping the last reference stops Mooncake's threads and closes its ports

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
