"""Where a pipelined cell's leader gets its work: the :class:`WorkSource` protocol, the per-batch
:class:`PipelineStats`, and :class:`QueueSource` (a micro-step queue claimed by this one cell).

A cell that shares the queue with other claimants (the core alongside claiming satellites in ``gyre run``) does not
use a source: it runs one claimed item at a time through :class:`gyre_train.megatron.cell.PipelinedWorker`, which
keeps the same continuous 1F1B across the items it is handed.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Protocol

from gyre_train.queue import MicroStepQueue
from gyre_train.types import PrepassResult, TrainResult, WorkItem

__all__ = ["PipelineStats", "QueueSource", "WorkSource"]


@dataclass(slots=True)
class PipelineStats:
    """What one rank's pipeline did over a batch (every rank of a cell counts the same, except ``waited_s``)."""

    microsteps: int = 0
    """Train items (forward + backward)."""
    forward_only: int = 0
    """Pre-pass items (forward only, at a consistent point)."""
    fills: int = 0
    """Times the pipeline started from empty (a warm-up)."""
    drains: int = 0
    """Times it ran its cool-down to empty."""
    pauses: int = 0
    """Times it stopped with work in flight, state kept, because nothing was claimable."""
    resumes: int = 0
    """Times a train item continued a paused pipeline."""
    starved_waits: int = 0
    """Leader only: idle spells in which only new data could give the cell work (data late), as opposed to
    waiting for outstanding pre-pass results."""

    def add(self, other: PipelineStats) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


class WorkSource(Protocol):
    """Where a pipelined cell's leader gets work and reports results (the shared queue seen by one cell)."""

    cell: int

    def claim(self) -> WorkItem | None:
        """One item for this cell, or None if nothing is claimable now."""
        ...

    def report(self, result: PrepassResult | TrainResult) -> None: ...

    def exhausted(self) -> bool:
        """The stream is closed and nothing more will ever be claimable by this cell in this batch: drain."""
        ...

    def starved(self) -> bool:
        """Nothing is claimable and only new data (not outstanding results) can change that."""
        ...

    @property
    def changes(self) -> int:
        """A counter that moves whenever claimability may have changed (put, close, report)."""
        ...

    def wait(self, since: int, timeout: float) -> None:
        """Return once ``changes != since`` (or after ``timeout`` seconds)."""
        ...


class QueueSource:
    """A :class:`~gyre_train.queue.MicroStepQueue` fed by another thread (``put`` / ``close``) and claimed by one
    pipelined cell; tracks the cell's own claims to know when the batch is exhausted for it."""

    def __init__(self, microsteps: MicroStepQueue, cell: int = 0) -> None:
        self.queue = microsteps
        self.cell = cell
        self._cond = threading.Condition()
        self._changes = 0
        self._closed = False
        self._train: set[int] = set()  # this cell's claimed train items not yet reported
        self._prepass: set[int] = set()

    def _bump(self) -> None:
        self._changes += 1
        self._cond.notify_all()

    def put(self, microstep) -> None:
        with self._cond:
            self.queue.put(microstep)
            self._bump()

    def close(self) -> None:
        with self._cond:
            self.queue.close()
            self._closed = True
            self._bump()

    def claim(self) -> WorkItem | None:
        with self._cond:
            item = self.queue.claim(self.cell)
            if item is not None:
                (self._train if item.kind == "train" else self._prepass).add(item.microstep.index)
            return item

    def report(self, result: PrepassResult | TrainResult) -> None:
        with self._cond:
            if isinstance(result, PrepassResult):
                self.queue.report_prepass(result)
                self._prepass.discard(result.index)
            else:
                self.queue.report_train(result)
                self._train.discard(result.index)
            self._bump()

    def exhausted(self) -> bool:
        """Closed, nothing unclaimed, no own pre-pass outstanding, every unfinished micro-step an own train item."""
        with self._cond:
            q = self.queue
            return (
                self._closed and q.unclaimed == 0 and not self._prepass and q.outstanding == len(self._train)
            )

    def starved(self) -> bool:
        """Open, nothing unclaimed, no own pre-pass outstanding: items waiting for a pre-pass wait for micro-steps
        not put yet (this source is the queue's only cell)."""
        with self._cond:
            return not self._closed and self.queue.unclaimed == 0 and not self._prepass

    @property
    def changes(self) -> int:
        with self._cond:
            return self._changes

    def wait(self, since: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._changes != since, timeout=timeout)
