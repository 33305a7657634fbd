"""The exceptions gyre_cell raises to its callers, in one place (each module that raises one imports it from here)."""

from __future__ import annotations

from gyre_train.errors import SnapshotError

__all__ = [
    "BadRequest",
    "CellCommandError",
    "CommandRefused",
    "EngineError",
    "EngineInputError",
    "EngineStateError",
    "IllegalRoleTransition",
    "KVCacheFullError",
    "KVMigrationError",
    "MooncakeUnavailableError",
    "RoleSwitchError",
    "SamplingError",
    "StaleSnapshotError",
    "TornSnapshotError",
    "TransferError",
    "TransferTimeoutError",
    "VLLMEnvError",
    "WeightError",
    "ZygoteError",
]


class EngineError(RuntimeError):
    """The engine answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"engine answered {status}: {message}")
        self.status = status
        self.message = message


class KVCacheFullError(RuntimeError):
    """The pool has no free or evictable block left."""


class EngineInputError(ValueError):
    """A request the engine refuses (bad ids, bad sampling params, unknown rid); maps to HTTP 400."""


class EngineStateError(RuntimeError):
    """An operation not allowed in the engine's current state (e.g. release while busy); HTTP 400."""


class SamplingError(ValueError):
    """A row's distribution cannot be sampled (non-finite logits)."""


class BadRequest(Exception):
    """Raised by handlers; rendered as SGLang's 400 error body."""


class WeightError(ValueError):
    """A weight operation that cannot be applied (bad names, shapes, or state); maps to HTTP 400."""


class IllegalRoleTransition(RuntimeError):
    """A switch was asked from a role that does not allow it (or while another switch runs)."""


class RoleSwitchError(RuntimeError):
    """A phase of a switch failed; the cell stays in the transitional role and the same switch may be retried."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"role switch failed in phase {phase!r}: {type(cause).__name__}: {cause}")
        self.phase = phase


class MooncakeUnavailableError(RuntimeError):
    """The Mooncake transfer engine cannot be imported or initialized on this machine."""


class TornSnapshotError(RuntimeError):
    """No consistent snapshot within the allowed attempts (the publisher kept writing or a write failed)."""


class TransferError(RuntimeError):
    """A Mooncake read failed (peer gone, address not registered, layout mismatch)."""


class TransferTimeoutError(TransferError):
    """A Mooncake read still running after its timeout: its late bytes may still land, so the buffer it was
    reading into is unusable (the subscriber closes itself)."""


class VLLMEnvError(RuntimeError):
    """The environment could not be made (the message says which step failed and why)."""


class CellCommandError(RuntimeError):
    """A cell refused or failed a command; the message is the cell's own."""


class CommandRefused(Exception):
    """A well-formed command the cell cannot carry out in its state or with what it names (a batch for another
    version, a checkpoint that is not one, a group whose files do not read): answered with `status` (4xx) and the
    message, never a 500."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ZygoteError(RuntimeError):
    """The zygote did not start, a module it preloads failed to import, or a fork failed."""


class KVMigrationError(EngineStateError):
    """A pin the engine cannot make (nothing cached for the request, Mooncake unavailable, pool released)."""


class StaleSnapshotError(SnapshotError):
    """The publisher no longer holds the batch a ref names (it has moved on, or never reached it)."""
