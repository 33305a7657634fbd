"""The exceptions gyre_tito raises to its callers, in one place (each module that raises one imports it from here)."""

from __future__ import annotations

__all__ = [
    "EngineRejected",
    "EnginesExhausted",
    "ProtocolError",
    "RecordLogCorrupt",
    "TemplateError",
    "TreeError",
]


class ProtocolError(Exception):
    """A client error, rendered by each API layer in its own error shape."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status = status
        self.kind = kind  # e.g. invalid_request_error, authentication_error, not_found_error
        self.message = message


class EnginesExhausted(Exception):
    """No engine could finish the call within the configured attempts (the proxy answers 529). Not
    `gyre_cell.client.EngineError`, which is one engine's error answer to one request."""


class EngineRejected(Exception):
    """An engine refused the request itself (HTTP 400/422, e.g. input longer than its context): retrying elsewhere
    cannot help, and tokens already produced are discarded with the call."""


class RecordLogCorrupt(RuntimeError):
    """A record log is damaged somewhere other than its last record (not a torn append)."""


class TemplateError(ValueError):
    """The chat template rejected the conversation (it raised, or the input had no renderable shape)."""


class TreeError(ValueError):
    """A record does not fit the tree (unknown parent, duplicate call id, wrong execution or sequence number)."""
