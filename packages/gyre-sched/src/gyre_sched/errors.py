"""The exceptions gyre_sched raises to its callers, in one place (each module that raises one imports it from here)."""

from __future__ import annotations

__all__ = ["InvariantError", "PlotsUnavailable", "SecretError"]


class InvariantError(AssertionError):
    """A scheduler invariant broke, or an event contradicts the scheduler's state."""


class PlotsUnavailable(ImportError):
    """matplotlib is not installed: plots are the optional extra `gyre-sched[plot]`."""


class SecretError(ValueError):
    """A token source that cannot be used (missing, not a regular file, readable by others, empty, too large)."""
