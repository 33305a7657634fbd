"""Wire types of gyre-eval: what other packages and processes send to and receive from the reward service.

An assessment never confuses a missing score with a zero: ``unresolved`` carries ``score=None``, ``valid`` carries a
finite score (a valid zero is ``0.0``) and ``no_work`` carries the placeholder reward ``0.0``. The validators below make
any other combination unrepresentable.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gyre_sched.types import Outcome

AssessmentStatus = Literal["valid", "unresolved", "no_work"]
GroupState = Literal["pending", "ready", "dropped"]
AdvantageMode = Literal["grpo", "mean"]

_ID = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]*$")


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = 1


MAX_TASK_DEPTH = 32
MAX_UNIX_TIME = 1e11  # year 5138: anything later is a mistake, and keeps launched_at + budget_s finite
MAX_BUDGET_S = 10 * 365 * 86400.0


def check_depth(value: Any, limit: int, where: str) -> None:
    """Raise ValueError when `value` nests lists/dicts deeper than `limit` (iteratively: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                raise ValueError(f"{where}: nested deeper than {limit} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


class Submission(_Wire):
    """A request to assess one preserved artifact state of one execution (sent by the execution runner)."""

    execution_id: str = _ID
    group_id: str = _ID
    # counts and indices are JSON integers (strict): lax mode took `true` for 1
    group_size: int = Field(strict=True, ge=1, le=100_000)
    """N: valid rewards the group needs before its advantages exist."""
    group_dispatched: int | None = Field(default=None, strict=True, ge=1, le=100_000)
    """N_d = N + k_spare executions dispatched for the group; None means N (no oversampling)."""
    dispatch_index: int = Field(strict=True, ge=0)
    """Position of the execution in its group's dispatch order; spares replace excluded executions in this order."""
    artifact_ref: str | None = Field(default=None, min_length=1, max_length=4096)
    """Path of the preserved workspace; None when the execution left no assessable work (``no_work``)."""
    artifact_version: str = Field(default="final", min_length=1, max_length=256)
    branch: str = Field(default="main", min_length=1, max_length=256)
    evaluator: str = Field(default="task", min_length=1, max_length=128)
    """Name of a configured evaluator."""
    designated: bool = Field(True, strict=True)
    """True for the one task assessment that supplies the execution's reward; False for intermediate ones."""
    launched_at: float = Field(gt=0)
    """Unix time the execution launched: the overall budget is measured from here."""
    budget_s: float = Field(gt=0)
    """Overall budget (execution plus evaluation retries), in seconds from launch."""
    outcome: Outcome = "completed"
    """How the execution ended, in its producer's vocabulary (the execution runner's, ``gyre_sched.types.Outcome``):
    recorded for provenance only, the score never depends on it."""
    no_work_reason: str | None = Field(default=None, max_length=2000)
    """Set when the execution failed completely (e.g. image pull): a zero-reward placeholder stands in."""
    task: dict[str, Any] = Field(default_factory=dict)
    """Task data the evaluator may use (e.g. the prompt a judge sees). Never credentials. At most 32 levels deep."""

    @field_validator("task", mode="before")
    @classmethod
    def _shallow(cls, v: Any) -> Any:
        check_depth(v, MAX_TASK_DEPTH, "task")
        return v

    @model_validator(mode="after")
    def _check(self) -> Submission:
        dispatched = self.dispatched
        if dispatched < self.group_size:
            raise ValueError(f"group_dispatched ({dispatched}) must be >= group_size ({self.group_size})")
        if self.dispatch_index >= dispatched:
            raise ValueError(f"dispatch_index {self.dispatch_index} out of range for {dispatched} dispatched")
        if not math.isfinite(self.launched_at) or not math.isfinite(self.budget_s):
            raise ValueError("launched_at and budget_s must be finite")
        if self.launched_at > MAX_UNIX_TIME or self.budget_s > MAX_BUDGET_S:
            raise ValueError(
                f"launched_at must be a unix time before {MAX_UNIX_TIME:.0f} and budget_s at most {MAX_BUDGET_S:.0f} s"
            )
        if self.no_work_reason is not None and self.artifact_ref is not None:
            raise ValueError("a no_work submission has no artifact_ref")
        return self

    @property
    def dispatched(self) -> int:
        return self.group_dispatched if self.group_dispatched is not None else self.group_size

    @property
    def deadline(self) -> float:
        return self.launched_at + self.budget_s


class Provenance(_Wire):
    """Who produced the score and how; the critique is context for later requests, never a training target."""

    evaluator: str
    kind: str
    """Evaluator kind: ``exec``, ``judge``, a plug-in's own kind, or ``service`` (decided without an evaluator)."""
    describe: dict[str, Any] = Field(default_factory=dict)
    """The evaluator's self-description (command, judge model and endpoint, version); never secrets."""
    critique: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    last_error: str | None = None
    outcome: Outcome = "completed"
    """The execution's termination status as submitted: recorded, never used for the score."""


class Assessment(_Wire):
    """One assessment of one (execution, branch, artifact version, evaluator); immutable once ``final``."""

    id: str
    execution_id: str
    group_id: str
    dispatch_index: int = Field(ge=0)
    artifact_ref: str | None
    artifact_version: str
    branch: str
    evaluator: str
    designated: bool
    status: AssessmentStatus
    score: float | None
    final: bool
    """False while attempts continue; True once valid, no_work, or the budget expired (then excluded)."""
    attempts: int = Field(ge=0)
    provenance: Provenance
    submitted_at: float
    deadline: float
    resolved_at: float | None = None

    @model_validator(mode="after")
    def _check(self) -> Assessment:
        if self.status == "unresolved" and self.score is not None:
            raise ValueError("an unresolved assessment has no score (it is never a zero)")
        if self.status == "valid" and (self.score is None or not math.isfinite(self.score)):
            raise ValueError("a valid assessment has a finite score")
        if self.status == "no_work" and self.score != 0.0:
            raise ValueError("a no_work placeholder has reward 0.0")
        if self.status != "unresolved" and not self.final:
            raise ValueError(f"a {self.status} assessment is final")
        return self

    @property
    def excluded(self) -> bool:
        """The execution's trajectories are excluded from training (its budget expired without a valid score)."""
        return self.final and self.status == "unresolved"


class AttemptRecord(_Wire):
    """One evaluator attempt; append-only history."""

    assessment_id: str
    number: int = Field(ge=1)
    started_at: float
    finished_at: float
    ok: bool
    score: float | None
    error: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class MemberReward(_Wire):
    execution_id: str
    dispatch_index: int
    status: AssessmentStatus
    reward: float
    advantage: float | None = None


class GroupStatus(_Wire):
    """Readiness of one rollout group: ready with N valid rewards, pending, or dropped (can never reach N)."""

    group_id: str
    size: int
    dispatched: int
    state: GroupState
    valid: int
    excluded: int
    pending: int
    members: list[MemberReward] = Field(default_factory=list)
    """When ready: the N executions whose rewards form the group, in dispatch order, with advantages."""
    advantage_mode: AdvantageMode = "grpo"
    reason: str | None = None


class ExecutionReport(_Wire):
    """An execution's reward as the trainer sees it, with its full assessment history."""

    execution_id: str
    status: AssessmentStatus | None
    """Status of the designated task assessment; None if none was submitted yet."""
    reward: float | None
    """The designated assessment's score when valid or no_work; None otherwise (never a stand-in zero)."""
    excluded: bool
    """The budget expired without a valid score: the execution's trajectories are not trained on."""
    designated: Assessment | None
    history: list[Assessment]
    """Every assessment of the execution (all branches, versions and evaluators), oldest first."""


class ErrorBody(_Wire):
    """The JSON shape of every 4xx answer of the service."""

    error: str
    message: str
