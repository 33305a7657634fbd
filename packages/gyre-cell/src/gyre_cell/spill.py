"""Tensors parked on disk while their memory is lent to someone else, in a file that has no name.

A cell on CPU offloads its training state (`roles.TorchTrainingState`), and an engine releasing its weights with a
disk backup (`engine.weights.WeightStore`) parks them, so the other side can use the RAM. A named temporary file
outlives a process that is killed while it is parked: every SIGKILLed cell (a failover test, a node loss, a killed
controller taking its children) used to leave its state in the temp folder, hundreds of MB per test suite. The spill
is an unnamed file (O_TMPFILE where the file system has it, else created and unlinked at once), so the kernel frees
its blocks when the process goes, however it goes.

The format is private and lives only as long as the object: the raw bytes of each tensor, one after another; the
names, dtypes, shapes and offsets stay in memory.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["SpillFile"]


@dataclass(frozen=True, slots=True)
class _Slot:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a contiguous CPU tensor; 0-dim and bf16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class SpillFile:
    """Write `tensors` (CPU copies are made of device tensors) to an unnamed file; `load` reads them back.

    `close` (or garbage collection of the object) frees the disk space; so does the process's death."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dir: str | None = None) -> None:
        self._file = tempfile.TemporaryFile(prefix="gyre-spill-", dir=dir)  # noqa: SIM115 (lives with the object)
        self._slots: dict[str, _Slot] = {}
        offset = 0
        try:
            for name, tensor in tensors.items():
                t = tensor.detach().to("cpu").contiguous()
                nbytes = t.numel() * t.element_size()
                if nbytes:
                    self._file.write(_bytes_of(t))
                self._slots[name] = _Slot(t.dtype, tuple(t.shape), offset, nbytes)
                offset += nbytes
            self._file.flush()
        except BaseException:
            self._file.close()
            raise

    @property
    def nbytes(self) -> int:
        """Bytes on disk."""
        return sum(s.nbytes for s in self._slots.values())

    def load(self) -> dict[str, torch.Tensor]:
        """Fresh CPU tensors equal to what was written (the file stays until `close`)."""
        if self._file.closed:
            raise ValueError("spill file is closed")
        out: dict[str, torch.Tensor] = {}
        fd = self._file.fileno()
        for name, slot in self._slots.items():
            t = torch.empty(slot.shape, dtype=slot.dtype)
            view, done = _bytes_of(t), 0
            while done < slot.nbytes:  # pread may return short reads for large tensors
                n = os.preadv(fd, [view[done:]], slot.offset + done)
                if n <= 0:
                    raise OSError(f"spill file ended early reading {name!r}")
                done += n
            out[name] = t
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
