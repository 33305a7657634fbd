"""The evaluator plug-in interface.

An evaluator turns one preserved artifact state into a score. It sees only what the score may depend on: the
workspace, the artifact version and branch, the task data, and a deadline. It never sees elapsed time, trajectory
length or how the execution ended, so a score cannot depend on them. It signals failure by raising (any exception);
the service then retries against the same preserved state within the execution's budget. Returning a score means the
artifact was assessed: a valid zero is a score of 0.0, never a way to report a failure.

Contract (checked by ``gyre_eval.contract.check_evaluator``, which every evaluator must pass):
- ``kind`` is a short string and ``describe()`` returns JSON-serializable provenance without secrets;
- ``evaluate`` is a coroutine returning a ``Verdict`` with a finite score;
- the preserved workspace is not modified; the same state gives the same score;
- it finishes (returns or raises) by the request's deadline;
- ``aclose`` releases its resources.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EvaluationRequest:
    """What an evaluator may look at. Deliberately without timing, trajectory or termination data."""

    execution_id: str
    workspace: Path
    """The preserved workspace: read it, never write it (checks run on a private copy)."""
    artifact_version: str
    branch: str
    deadline: float
    """Unix time by which the attempt must finish (the execution's overall budget)."""
    task: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    score: float
    critique: str | None = None
    """Free-text feedback; recorded with evaluator provenance, never a training target."""
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Evaluator(Protocol):
    kind: str

    def describe(self) -> dict[str, Any]:
        """Provenance: what this evaluator is (command, model, endpoint, version). No secrets."""
        ...

    async def evaluate(self, request: EvaluationRequest) -> Verdict: ...

    async def aclose(self) -> None: ...


def load_factory(ref: str) -> Any:
    """Resolve ``"package.module:attribute"`` (a plug-in's factory or class)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"plug-in factory {ref!r} must look like 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"plug-in factory {ref!r}: cannot import {module_name}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ValueError(f"plug-in factory {ref!r}: {module_name} has no attribute {attr}") from e
    return obj


def build_plugin(ref: str, options: dict[str, Any]) -> Evaluator:
    evaluator = load_factory(ref)(**options)
    if not isinstance(evaluator, Evaluator):
        raise ValueError(
            f"plug-in {ref!r} built {type(evaluator).__name__}, which lacks kind/describe/evaluate/aclose"
        )
    return evaluator
