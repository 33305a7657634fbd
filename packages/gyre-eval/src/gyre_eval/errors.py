"""The exceptions gyre_eval raises to its callers, in one place (each module that raises one imports it from here)."""

from __future__ import annotations

__all__ = [
    "ArtifactOutsideRootsError",
    "CgroupUnavailable",
    "ConflictError",
    "EvalServiceError",
    "EvaluatorError",
    "NotFoundError",
    "SandboxError",
    "UnknownEvaluatorError",
]


class CgroupUnavailable(Exception):
    """No writable cgroup with the needed controllers (the reason is the message)."""


class EvalServiceError(Exception):
    """The service refused a request (4xx/5xx); ``error`` and ``message`` come from its ErrorBody."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(f"HTTP {status} {error}: {message}")
        self.status, self.error, self.message = status, error, message


class EvaluatorError(Exception):
    """The evaluator could not assess the artifact (the assessment stays unresolved; it is never a zero)."""


class SandboxError(Exception):
    """The sandbox could not be set up (never a verdict on the artifact)."""


class NotFoundError(LookupError):
    pass


class ArtifactOutsideRootsError(ValueError):
    """A submission's artifact_ref resolves outside ``ServiceConfig.artifact_roots`` (HTTP 422)."""


class UnknownEvaluatorError(ValueError):
    """A submission names an evaluator the service does not have (HTTP 422)."""


class ConflictError(Exception):
    """A submission contradicts what the store already holds (HTTP 409)."""
