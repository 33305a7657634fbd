"""The publisher's buffer in shared memory, so that a subscriber on the same host reads it without a transfer.

Mooncake's TCP transport moves a 210 MB buffer over loopback at ~1.5 GiB/s (0.14 s, and CPU on both ends); a
process on the same host can map the publisher's pages instead and copy straight from them into its parameters
(0.04 s). The publisher's buffer is an anonymous memory file (`memfd_create`): it is registered with Mooncake like
any memory (peers on other hosts pull it as before), leaves nothing behind when the publisher exits, and is reached
by `/proc/<pid>/fd/<fd>`, which only processes of the same user may open. The manifest names that path, the host's
boot id and a random nonce the publisher wrote into its header; a subscriber maps the path read-only and uses it
only if the boot id is its own and the nonce is there (another host, another PID namespace: Mooncake as before).

An engine whose parameters are views of a mapped buffer (`WeightStore.bind`) holds a `SlotLease` on it: a shared
`flock` on its own open of the file (a separate open file description, so it conflicts with the publisher's). The
publisher takes the exclusive lock before it writes a buffer (`SharedBuffer.lock_exclusive`): it never overwrites
the weights an engine is serving, and the kernel drops a dead engine's lock with its process.

An engine that missed a publication (its load failed, or it hung) would hold its lease forever and stop every
publication after the next one. So the publisher waits for the lock only a bounded time, then writes anyway; the
lease remembers the sequence number of what it holds (`SlotLease.watch`), and the engine checks it after every step
(`WeightStore.intact`): a step that ran while its pages were being rewritten is thrown away and the engine serves
nothing until it loads again (`TorchEngine` revokes its weights). A lagging engine fails its calls; it never serves
torn weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .manifest import NONCE_SLICE, SEQ, SharedMemoryRef

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This host's boot id (Linux), or None."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return None


def _frombuffer(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping: torch warns that the tensor must not be written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


@dataclass
class SharedBuffer:
    """A zeroed uint8 tensor in a memory file; `ref` tells a same-host subscriber how to map it."""

    tensor: torch.Tensor
    ref: SharedMemoryRef
    _fd: int
    _map: mmap.mmap

    @classmethod
    def create(cls, length: int) -> SharedBuffer | None:
        """None where memory files or the boot id are missing (then the publisher uses private memory)."""
        host = boot_id()
        if host is None or not hasattr(os, "memfd_create"):
            return None
        try:
            fd = os.memfd_create("gyre-weights", os.MFD_CLOEXEC)
        except OSError:
            return None
        try:
            os.ftruncate(fd, length)
            mm = mmap.mmap(fd, length, mmap.MAP_SHARED)
        except OSError:
            os.close(fd)
            return None
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
        nonce = secrets.token_bytes(NONCE_SLICE.stop - NONCE_SLICE.start)
        tensor[NONCE_SLICE] = torch.frombuffer(bytearray(nonce), dtype=torch.uint8)
        ref = SharedMemoryRef(path=f"/proc/{os.getpid()}/fd/{fd}", boot_id=host, nonce=nonce.hex())
        return cls(tensor, ref, fd, mm)

    @property
    def identity(self) -> tuple[int, int]:
        st = os.fstat(self._fd)
        return st.st_dev, st.st_ino

    def lock_exclusive(self) -> bool:
        """Take the exclusive lock before a write; False while an engine holds a `SlotLease` on this buffer."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the file; the pages go once no mapping (a subscriber's included) and no tensor holds them."""
        with contextlib.suppress(OSError):
            os.close(self._fd)


class SlotLease:
    """A shared lock on one publisher buffer, held while an engine's parameters are views of it.

    `take` returns None while the publisher writes the buffer (its exclusive lock) or when the path is no longer
    the file `identity` names. `release` is idempotent; a lease never released goes with its process."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.path = path
        self._header: torch.Tensor | None = None
        self._seq = 0

    def watch(self, header: torch.Tensor, seq: int) -> None:
        """`header`: the int64 words of the slot's header as mapped here; `seq`: its sequence number when taken."""
        self._header, self._seq = header, seq

    def intact(self) -> bool:
        """Whether the publisher has not begun to rewrite the slot since the lease was taken (it does so only after
        waiting for the lock in vain: the holder missed a publication). A seqlock read: check it after the reads
        it vouches for."""
        return self._header is None or int(self._header[SEQ]) == self._seq

    @classmethod
    def take(cls, path: str, identity: tuple[int, int]) -> SlotLease | None:
        try:
            fd = os.open(
                path, os.O_RDONLY | os.O_CLOEXEC
            )  # a description of our own: flock conflicts across them
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != identity:
                raise BlockingIOError
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)  # explicit: a forked child holding the fd must not keep it
                os.close(fd)

    def __del__(self) -> None:
        self.release()


@dataclass
class SharedMapping:
    """A publisher's buffer mapped read-only here. The mapping outlives the publisher, so `alive` asks whether its
    memory file is still the one at the manifest's path (gone, or a reused pid's other file: the publisher left)."""

    tensor: torch.Tensor
    path: str
    identity: tuple[int, int]

    def alive(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity


def map_shared(ref: SharedMemoryRef, length: int) -> SharedMapping | None:
    """The publisher's buffer mapped read-only, if it is on this host and is the one the manifest describes."""
    if ref.boot_id != boot_id():
        return None
    try:
        fd = os.open(ref.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # another PID namespace, another user, the publisher gone
        return None
    try:
        st = os.fstat(fd)
        if st.st_size != length:
            return None
        mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)  # the mapping keeps the pages
    tensor = _frombuffer(mm)
    if bytes(tensor[NONCE_SLICE].numpy()) != bytes.fromhex(ref.nonce):
        return None  # the same path in another process (a PID namespace): not this publisher's buffer
    return SharedMapping(tensor, ref.path, (st.st_dev, st.st_ino))


@dataclass
class LeasedSlot:
    """The newest publication on this host, held: `tensors` are read-only views of the publisher's pages, which it
    does not overwrite until `lease` is released (`WeightStore.bind` takes it over)."""

    version: int
    tensors: dict[str, torch.Tensor] = field(repr=False)
    lease: SlotLease
    region: tuple[int, int]
    """[start, end) addresses of the mapped slot in this process."""
