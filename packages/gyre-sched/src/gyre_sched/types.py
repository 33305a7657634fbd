"""Wire types of gyre-sched: what the controller sends to runners, cells and the proxy, and what they report back.

Every model is frozen, rejects unknown fields and carries ``schema_version``. ``TraceLine`` is the line model of
``trace.jsonl`` (docs/design/architecture.md#run-directory-and-trace): a real run and the simulator write the same lines through ``gyre_sched.trace.TraceWriter``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_ID = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]*$")

# How an execution ended (docs/design/index.md#vocabulary, docs/design/assessments.md). harness_timeout: the task's own deadline (work is assessed and trained on);
# overall_timeout: the overall budget ran out (excluded); stalled: the run's stall watchdog ended an execution that
# made no model call for its detection window (excluded, like an overall timeout, only known earlier); cancelled:
# surplus spare or a member of a dropped group.
Outcome = Literal["completed", "failed", "harness_timeout", "overall_timeout", "stalled", "cancelled"]
# What the controller learns from the evaluator: valid score, no_work placeholder (a valid zero), or excluded
# (unresolved when the overall budget expired: never a zero).
AssessedStatus = Literal["valid", "no_work", "excluded"]


class CellRole(StrEnum):
    """Role of a cell (docs/design/cells.md): ROLLOUT -> TO_TRAINING -> TRAINING -> TO_ROLLOUT -> ROLLOUT."""

    ROLLOUT = "rollout"
    TO_TRAINING = "to_training"
    TRAINING = "training"
    TO_ROLLOUT = "to_rollout"
    LOST = "lost"
    """The cell's worker died (CellLost): it serves and trains no more, unless it is restarted (CellRestored)."""


_NEXT_ROLE = {
    CellRole.ROLLOUT: CellRole.TO_TRAINING,
    CellRole.TO_TRAINING: CellRole.TRAINING,
    CellRole.TRAINING: CellRole.TO_ROLLOUT,
    CellRole.TO_ROLLOUT: CellRole.ROLLOUT,
}


def next_role(role: CellRole) -> CellRole:
    """The only role a cell in ``role`` may move to."""
    return _NEXT_ROLE[role]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = 1


class ExecutionSpec(_Wire):
    """A launch order for the execution runner: create the harness and sandbox now (queued entries have neither)."""

    execution_id: str = _ID
    group_id: str = _ID
    query_id: str = _ID
    dispatch_version: int = Field(ge=0)
    """v_d: latest published policy version when the group was dispatched."""
    dispatch_index: int = Field(ge=0)
    """Position in the group's dispatch order (0..N_d-1); spares replace excluded executions in this order."""
    harness_timeout_s: float = Field(gt=0)
    """The task's own deadline: the execution stops and its work is still assessed and trained on."""
    overall_budget_s: float = Field(gt=0)
    """Execution plus evaluation retries, from launch; exhausted without a valid score -> excluded."""
    engine: str = _ID
    """Rollout engine the execution's model calls go to first (later changes arrive as Route messages)."""

    @model_validator(mode="after")
    def _budgets(self) -> ExecutionSpec:
        if self.overall_budget_s < self.harness_timeout_s:
            raise ValueError(
                "overall_budget_s must be >= harness_timeout_s (it covers execution plus evaluation)"
            )
        return self


class ExecutionEvent(_Wire):
    """Reported by the execution runner: an execution launched, or terminated (exactly once) with an outcome."""

    execution_id: str = _ID
    kind: Literal["launched", "terminated"]
    outcome: Outcome | None = None
    """Set iff kind == 'terminated'."""

    @model_validator(mode="after")
    def _outcome_iff_terminated(self) -> ExecutionEvent:
        if (self.kind == "terminated") != (self.outcome is not None):
            raise ValueError("outcome is required for kind='terminated' and forbidden for kind='launched'")
        return self


class CellTransition(_Wire):
    """An order to (or report that) a cell changes role; only the next role in the cycle is allowed."""

    cell: int = Field(ge=0)
    from_role: CellRole
    to_role: CellRole
    phase: Literal["begin", "end"] = "begin"

    @model_validator(mode="after")
    def _legal(self) -> CellTransition:
        if next_role(self.from_role) != self.to_role:
            raise ValueError(f"illegal transition {self.from_role.value} -> {self.to_role.value}")
        return self


class Route(_Wire):
    """Where an execution's model calls go: the proxy retries outstanding requests on the new engine."""

    execution_id: str = _ID
    engine: str = _ID
    """'standalone' or 'cell:<index>'."""
    reason: Literal["launch", "reroute"] = "launch"


TraceEventName = Literal[
    "header",
    "dispatch",
    "launch",
    "terminate",
    "withdraw",
    "assessed",
    "group_ready",
    "group_dropped",
    "transition_begin",
    "transition_end",
    "batch_open",
    "group_assign",
    "microstep_claim",
    "step_end",
    "publish_begin",
    "publish",
    "route",
    "burst_plan",
    "resume",
    "run_end",
    "cell_lost",
    "cell_restored",
    "cell_untrained",
    "collective_failed",
]

# Fields each event must carry (more are allowed: a real run may add its own context).
TRACE_REQUIRED: dict[str, tuple[str, ...]] = {
    "header": ("K", "C_e", "C_s", "N", "B", "phi", "mu"),
    "dispatch": ("group", "executions", "v_d"),
    "launch": ("execution",),
    "terminate": ("execution", "outcome"),
    "withdraw": ("execution",),
    "assessed": ("execution", "status"),
    "group_ready": ("group",),
    "group_dropped": ("group",),
    "transition_begin": ("cell", "from", "to"),
    "transition_end": ("cell", "from", "to"),
    "batch_open": ("version",),
    "group_assign": ("group", "version"),
    "microstep_claim": ("cell",),
    "step_end": ("version", "groups", "staleness"),
    "publish_begin": ("version",),
    "publish": ("version",),
    "route": ("execution", "engine"),
    "burst_plan": ("version", "mu", "dispatch", "k_spare"),
    # A resumed run (gyre run --resume): executions of the interrupted part that were running (cancelled) or
    # queued (withdrawn) are settled here, and every cell restarts in the role of the resumed policy's start.
    "resume": ("version", "cancelled", "withdrawn", "roles"),
    # The run ended (its steps done, or it failed): executions still running were cancelled then and those queued
    # never launched. Counters stay the policy's own at its last event (a later resume line settles these).
    "run_end": ("version", "steps", "cancelled", "withdrawn"),
    "cell_lost": ("cell",),
    "cell_restored": ("cell",),
    "cell_untrained": ("cell",),
    # The end-of-batch reduce or broadcast of batch `version` failed with these satellites (one died or hangs in
    # it): the core ran their micro-steps again and updated alone; they train again after the next re-form.
    "collective_failed": ("version", "cells"),
}


class TraceLine(BaseModel):
    """One line of trace.jsonl: ``{"t": seconds since run start, "ev": NAME, ...event fields}``."""

    model_config = ConfigDict(frozen=True, extra="allow")
    t: float = Field(ge=0)
    ev: TraceEventName

    @model_validator(mode="after")
    def _fields(self) -> TraceLine:
        extra: dict[str, Any] = self.model_extra or {}
        missing = [k for k in TRACE_REQUIRED[self.ev] if k not in extra]
        if missing:
            raise ValueError(f"trace event {self.ev!r} lacks field(s) {missing}")
        return self

    def fields(self) -> dict[str, Any]:
        """The event's own fields (everything but t and ev)."""
        return dict(self.model_extra or {})


__all__ = [
    "TRACE_REQUIRED",
    "AssessedStatus",
    "CellRole",
    "CellTransition",
    "ExecutionEvent",
    "ExecutionSpec",
    "Outcome",
    "Route",
    "TraceEventName",
    "TraceLine",
    "next_role",
]
