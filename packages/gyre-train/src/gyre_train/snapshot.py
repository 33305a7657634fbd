"""The core's per-batch weight snapshot for joining satellites (docs/design/training.md#multi-cell-training): a pluggable channel.

At batch open the core ``publish``es its flat parameters (fixed during accumulation) and hands the returned reference
to every satellite that joins the batch (``CoordinatorReply.snapshot``); the satellite ``load``s the parameters the
reference names. Any object with these three methods is a channel (structural typing): :class:`FileSnapshotChannel`
here (one process per cell on one machine), ``gyre_cell.transfer.snapshot_channel.MooncakeSnapshotChannel`` (Mooncake
transfer engine, TCP or RDMA) in gyre-cell. The core and each satellite hold their own channel object.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from gyre_train.errors import SnapshotError


@runtime_checkable
class SnapshotChannel(Protocol):
    """How the core exposes a batch's weights to satellites and how they read them."""

    def publish(self, batch: int, params: torch.Tensor) -> str:
        """Core, at batch open: expose the flat parameters (fixed during accumulation); return a reference string."""
        ...

    def load(self, ref: str) -> torch.Tensor:
        """Satellite: the flat parameters the reference names (a consistent snapshot; raise on a torn or stale read).
        The tensor may be the channel's own buffer, valid until its next `load`: copy it out before loading again."""
        ...

    def close(self) -> None: ...


_NAME = re.compile(r"snapshot-(\d+)\.pt")


class FileSnapshotChannel:
    """One atomic file per batch in a directory (``snapshot-<batch>.pt``); publishing removes the previous ones.

    The file is written to a temporary name and renamed, so a reader never sees a partial file (no torn read); a
    reference whose file is gone (the core published a later batch) raises :class:`SnapshotError` (stale).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def publish(self, batch: int, params: torch.Tensor) -> str:
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        path = self.directory / f"snapshot-{batch}.pt"
        tmp = self.directory / f".snapshot-{batch}.pt.tmp"
        torch.save(params.detach().cpu().clone(), tmp)
        os.replace(tmp, path)  # readers never see a partial file
        for old in self.directory.glob("snapshot-*.pt"):
            m = _NAME.fullmatch(old.name)
            if m is not None and int(m.group(1)) != batch:
                old.unlink(missing_ok=True)
        return str(path)

    def load(self, ref: str) -> torch.Tensor:
        if _NAME.fullmatch(Path(ref).name) is None:
            raise ValueError(f"not a file snapshot reference: {ref!r} (expected .../snapshot-<batch>.pt)")
        try:
            return torch.load(ref, weights_only=True)
        except FileNotFoundError as exc:
            raise SnapshotError(f"stale snapshot {ref}: the core has published a later batch") from exc

    def close(self) -> None:
        """Nothing to release (the last snapshot file stays for inspection)."""
