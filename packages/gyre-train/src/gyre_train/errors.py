"""The exceptions gyre_train raises to its callers, in one place (each module that raises one imports it from here)."""

from __future__ import annotations

__all__ = ["DataStarvation", "LateReport", "RendezvousTimeout", "SnapshotError", "StepAborted"]


class StepAborted(RuntimeError):
    """``CoreRunner.step`` stopped waiting because its ``abort`` event was set; the open batch is abandoned (the
    trainer stays inside it: end the run, or build a new trainer from a checkpoint)."""


class LateReport(ValueError):
    """A result for an item the reporting cell does not hold (requeued after its cell was dropped)."""


class SnapshotError(RuntimeError):
    """A snapshot reference cannot be read consistently (stale: the core has moved on, or torn)."""


class DataStarvation(RuntimeError):
    """The batch needs more ready groups than the trajectory buffer holds (single-process loop cannot wait)."""


class RendezvousTimeout(RuntimeError):
    """Not every rank of a new world generation arrived within the rendezvous timeout (one died or hangs)."""
