"""The weight manifest (wire type) and the flat-buffer layout it describes.

The publisher holds one or two such buffers ("slots", each registered once), all laid out alike:
    [0, HEADER_BYTES)            header: int64 seq (even = stable, odd = write in progress), int64 version, int64 magic,
                                 16 bytes of nonce (a buffer in shared memory: `gyre_cell.transfer.shm`), int64
                                 generation (the publication counter across slots, written when a write closes)
    [HEADER_BYTES, length)       tensors, each at a 64-byte aligned offset; tied tensors share one offset
A reader takes the slot with the highest generation among the stable ones and compares its header before and after
copying the tensors (a seqlock), so it never keeps a torn snapshot. Two slots let an engine on the publisher's host
use the newest slot's pages as its parameters while the next publication is written into the other one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..weight_sync import dtype_name

HEADER_BYTES = 64
ALIGN = 64
MAGIC = 0x47595245_57544221  # "GYREWTB!": guards against reading a wrong address
SEQ, VERSION, MAGIC_SLOT, GENERATION = 0, 1, 2, 5
"""int64 indices into a header."""
NONCE_SLICE = slice(24, 40)
"""Bytes of the header holding a shared buffer's nonce (`SharedMemoryRef.nonce`)."""
MAX_SLOTS = 2

DTYPES: dict[str, torch.dtype] = {
    dtype_name(d): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = 1


class TensorEntry(_Wire):
    """One tensor in the flat buffer, by Hugging Face name."""

    name: str = Field(min_length=1)
    dtype: str
    """torch dtype name without the `torch.` prefix (`float32`, `bfloat16`, ...)."""
    shape: list[int]
    offset: int = Field(ge=HEADER_BYTES)
    """Byte offset from the start of the buffer (64-byte aligned)."""
    nbytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> TensorEntry:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r} (supported: {sorted(DTYPES)})")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        numel = 1
        for s in self.shape:
            numel *= s
        if numel * DTYPES[self.dtype].itemsize != self.nbytes:
            raise ValueError(f"{self.name}: nbytes {self.nbytes} != numel {numel} x {self.dtype}")
        if self.offset % ALIGN:
            raise ValueError(f"{self.name}: offset {self.offset} not {ALIGN}-byte aligned")
        return self


class SharedMemoryRef(_Wire):
    """Where a subscriber on the publisher's host maps its buffer (`gyre_cell.transfer.shm`)."""

    path: str = Field(min_length=1, max_length=256)
    """`/proc/<pid>/fd/<fd>` of the publisher's memory file."""
    boot_id: str = Field(min_length=1, max_length=64)
    """The host's boot id: a subscriber elsewhere does not try the path."""
    nonce: str = Field(pattern=r"^[0-9a-f]{32}$")
    """Hex of the 16 bytes the publisher wrote at `NONCE_SLICE` of its header: the mapped file is its buffer."""


class BufferSlot(_Wire):
    """One of the publisher's buffers."""

    addr: int = Field(gt=0)
    """Virtual address of the registered buffer in the publisher's process."""
    shm: SharedMemoryRef | None = None
    """The buffer in shared memory, for subscribers on the publisher's host (None: Mooncake only)."""


class WeightManifest(_Wire):
    """Handshake for pulling a publisher's weights: where its buffers are and what they hold."""

    peer: str = Field(min_length=3)
    """Mooncake segment name of the publisher (`host:rpc_port` in P2P handshake mode)."""
    slots: list[BufferSlot] = Field(min_length=1, max_length=MAX_SLOTS)
    """The buffers publications alternate between (readers take the newest stable one)."""
    length: int = Field(gt=HEADER_BYTES)
    """Bytes of each buffer, header included."""
    version: int = Field(ge=0)
    """Policy version published when this manifest was made (the headers hold the live one)."""
    tensors: list[TensorEntry]
    finite_checked: bool = False
    """The publisher refuses NaN or infinite floating-point values: a loader need not check them again."""

    @model_validator(mode="after")
    def _fits(self) -> WeightManifest:
        shared = [s.shm is not None for s in self.slots]
        if any(shared) and not all(shared):
            raise ValueError("either every slot is in shared memory or none is")
        if len({s.addr for s in self.slots}) != len(self.slots):
            raise ValueError("two slots at one address")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in manifest")
        for t in self.tensors:
            if t.offset + t.nbytes > self.length:
                raise ValueError(
                    f"{t.name}: [{t.offset}, {t.offset + t.nbytes}) outside buffer of {self.length}"
                )
        return self

    @property
    def data_bytes(self) -> int:
        return self.length - HEADER_BYTES

    @property
    def buffer_addr(self) -> int:
        """The first slot's address (a one-slot publisher's only buffer: the HTTP transport names it)."""
        return self.slots[0].addr

    @property
    def shared(self) -> bool:
        """The buffers are in shared memory (subscribers on the publisher's host may map them)."""
        return self.slots[0].shm is not None


def plan_layout(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorEntry], int]:
    """Entries and total buffer length for `named`; tensors sharing storage (tied weights) share an offset."""
    entries: list[TensorEntry] = []
    by_storage: dict[tuple[int, int, tuple[int, ...], torch.dtype], int] = {}
    cursor = HEADER_BYTES
    for name, t in named:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        nbytes = t.numel() * t.element_size()
        offset = by_storage.get(key) if t.numel() else None
        if offset is None:
            offset = cursor
            by_storage[key] = offset
            cursor += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        entries.append(
            TensorEntry(
                name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), offset=offset, nbytes=nbytes
            )
        )
    return entries, max(cursor, HEADER_BYTES + ALIGN)


def tensor_views(buffer: torch.Tensor, entries: Iterable[TensorEntry]) -> dict[str, torch.Tensor]:
    """Views of a uint8 buffer laid out by `entries` (no copies)."""
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        raw = buffer[e.offset : e.offset + e.nbytes]
        out[e.name] = raw.view(DTYPES[e.dtype]).view(e.shape)
    return out
