"""Wire types of gyre-tito: call records (what the proxy records per model call) and trajectories (what training reads).

API summary
-----------
- ``Provenance``: ``"policy"`` (our engine sampled the token) or ``"external"`` (anything else: system/user prompts, tool
  results, assistant text the harness injected, evaluator critiques).
- ``RoleClass``: ``"main/task" | "main/summary" | "sub/task" | "sub/summary" | "other"``; ``ROLE_PRIORITY`` is the
  admission order of docs/design/tito.md#provenance-mask-and-selection (``other`` is excluded by default).
- ``ProvenanceRun``: ``(source, length)``; ``CallRecord.input_provenance`` is a run-length list covering ``input_ids``.
  ``runs_from_mask`` / ``mask_from_runs`` convert to and from a per-token ``policy`` flag list.
- ``OutputSegment``: ``{engine_id, weight_version, start, end}``: which engine and weight version produced output tokens
  ``[start, end)`` (a retried call can be served by several engines/versions; segments tile the output exactly).
- ``Timings``: ``request_at`` / ``first_token_at`` / ``end_at`` (unix seconds).
- ``CallRecord``: one model call. ``input_ids`` are INCREMENTAL: the request's full context is
  ``path_tokens(parent) + input_ids`` where ``path_tokens(parent)`` is the parent's root path (input + output of every
  node); ``parent_id=None`` attaches to the root. ``output_ids`` / ``output_logprobs`` are exactly what the engine returned.
- ``WeightSpan``: ``{start, end, engine_id, weight_version}`` in trajectory token coordinates.
- ``Trajectory``: one admitted root-to-leaf path: ``token_ids``, ``target_mask`` (0/1), ``behavior_logprobs`` (aligned,
  0.0 where not a target), ``weight_versions`` (spans over every recorded output token in the path), ids and role class;
  ``placeholder=True`` is the zero-reward stand-in for an execution with no assessable work (no tokens, no targets).

All models are frozen pydantic v2 models with ``extra="forbid"`` and ``schema_version: Literal[1]``; they round-trip
through JSON (``Model.model_validate(orjson.loads(m.model_dump_json()))``) and reject malformed input with a
``pydantic.ValidationError`` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ROLE_CLASSES",
    "ROLE_PRIORITY",
    "CallRecord",
    "OutputSegment",
    "Provenance",
    "ProvenanceRun",
    "RoleClass",
    "Timings",
    "Trajectory",
    "WeightSpan",
    "mask_from_runs",
    "runs_from_mask",
]

Provenance = Literal["policy", "external"]
RoleClass = Literal["main/task", "main/summary", "sub/task", "sub/summary", "other"]
ROLE_CLASSES: tuple[RoleClass, ...] = ("main/task", "main/summary", "sub/task", "sub/summary", "other")
# Equation 7: agent first (main before sub), then purpose (task before summary). `other` is not ranked by default.
ROLE_PRIORITY: tuple[RoleClass, ...] = ("main/task", "main/summary", "sub/task", "sub/summary")

TokenId = int
ProvenanceRun = tuple[Provenance, int]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_tokens(name: str, ids: Sequence[int]) -> None:
    if ids and min(ids) < 0:
        raise ValueError(f"{name} contains a negative token id")


def _check_logprobs(name: str, values: Sequence[float]) -> None:
    # JSON cannot carry inf/nan (orjson writes null), and a non-finite behaviour log-prob would poison the ratio.
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} contains a non-finite value")


def runs_from_mask(policy: Sequence[bool]) -> list[ProvenanceRun]:
    """Run-length encode a per-token ``policy`` flag list (True = policy) into provenance runs."""
    runs: list[ProvenanceRun] = []
    for flag in policy:
        source: Provenance = "policy" if flag else "external"
        if runs and runs[-1][0] == source:
            runs[-1] = (source, runs[-1][1] + 1)
        else:
            runs.append((source, 1))
    return runs


def mask_from_runs(runs: Sequence[ProvenanceRun]) -> list[bool]:
    """Expand provenance runs into a per-token ``policy`` flag list."""
    out: list[bool] = []
    for source, length in runs:
        out.extend([source == "policy"] * length)
    return out


class OutputSegment(_Wire):
    """Output tokens ``[start, end)`` of a call were produced by ``engine_id`` at ``weight_version``."""

    schema_version: Literal[1] = 1
    engine_id: str = Field(min_length=1)
    weight_version: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> OutputSegment:
        if self.end <= self.start:
            raise ValueError(f"segment end ({self.end}) must be greater than start ({self.start})")
        return self


class Timings(_Wire):
    """Wall-clock times of one call (unix seconds)."""

    schema_version: Literal[1] = 1
    request_at: float
    first_token_at: float | None = None
    end_at: float

    @model_validator(mode="after")
    def _ordered(self) -> Timings:
        if self.end_at < self.request_at:
            raise ValueError("end_at is before request_at")
        return self


class CallRecord(_Wire):
    """One model call of one execution, exactly as the engine saw and produced it."""

    schema_version: Literal[1] = 1
    execution_id: str = Field(min_length=1)
    call_id: str = Field(min_length=1)
    seq: int = Field(ge=0, description="append order within the execution, 0, 1, 2, ...")
    parent_id: str | None = Field(description="node this call extends; None attaches to the root")
    input_ids: list[TokenId] = Field(
        description="incremental input: context tokens after the parent's root path"
    )
    input_provenance: list[ProvenanceRun] = Field(description="run-length provenance covering input_ids")
    output_ids: list[TokenId]
    output_logprobs: list[float] = Field(description="behaviour log-probs, aligned with output_ids")
    output_segments: list[OutputSegment] = Field(
        description="engine/version per output span; tiles output_ids"
    )
    agent_id: str = Field(min_length=1)
    role_class: RoleClass
    call_kind: str = Field(min_length=1, description="e.g. task, summary, side")
    finish_reason: str = Field(description="stop | length | tool_use | abort | ...")
    timings: Timings
    metadata: dict[str, Any] = Field(default_factory=dict, description="free-form JSON-able request metadata")

    @model_validator(mode="after")
    def _consistent(self) -> CallRecord:
        _check_tokens("input_ids", self.input_ids)
        _check_tokens("output_ids", self.output_ids)
        _check_logprobs("output_logprobs", self.output_logprobs)
        if self.parent_id == self.call_id:
            raise ValueError("a call cannot be its own parent")
        covered = 0
        for source, length in self.input_provenance:
            if length <= 0:
                raise ValueError(f"provenance run of {source!r} has non-positive length {length}")
            covered += length
        if covered != len(self.input_ids):
            raise ValueError(f"input_provenance covers {covered} tokens, input_ids has {len(self.input_ids)}")
        if len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"output_logprobs has {len(self.output_logprobs)} values for {len(self.output_ids)} output tokens"
            )
        pos = 0
        for seg in self.output_segments:
            if seg.start != pos:
                raise ValueError(
                    f"output_segments must tile the output: expected start {pos}, got {seg.start}"
                )
            pos = seg.end
        if pos != len(self.output_ids):
            raise ValueError(f"output_segments cover {pos} tokens, output_ids has {len(self.output_ids)}")
        return self

    @property
    def num_tokens(self) -> int:
        """Tokens this node adds to its path (incremental input + output)."""
        return len(self.input_ids) + len(self.output_ids)


class WeightSpan(_Wire):
    """Trajectory tokens ``[start, end)`` were sampled by ``engine_id`` at ``weight_version``."""

    schema_version: Literal[1] = 1
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    engine_id: str
    weight_version: str

    @model_validator(mode="after")
    def _ordered(self) -> WeightSpan:
        if self.end <= self.start:
            raise ValueError(f"span end ({self.end}) must be greater than start ({self.start})")
        return self


class Trajectory(_Wire):
    """One admitted trajectory (a root-to-leaf path of an execution's tree) with its fixed training targets."""

    schema_version: Literal[1] = 1
    execution_id: str = Field(min_length=1)
    group_id: str = Field(min_length=1)
    index: int = Field(ge=0, description="admission order within the execution (0 = first drawn)")
    leaf_call_id: str | None = Field(description="call id of the path's leaf; None for a placeholder")
    agent_id: str | None = None
    role_class: RoleClass
    token_ids: list[TokenId]
    target_mask: list[int] = Field(description="1 where the token is a training target, else 0")
    behavior_logprobs: list[float] = Field(description="aligned with token_ids; 0.0 where not a target")
    weight_versions: list[WeightSpan] = Field(
        description="spans over every recorded output token in the path"
    )
    placeholder: bool = False
    temperatures: list[float] | None = Field(
        None,
        description="aligned with token_ids: the temperature each target token was sampled at (its call's "
        "metadata['sampling']['used']['temperature']), 0.0 where not a target; None when a target call recorded "
        "none (the trainer then uses the run's temperature)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Trajectory:
        n = len(self.token_ids)
        _check_tokens("token_ids", self.token_ids)
        if len(self.target_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), target_mask ({len(self.target_mask)}) and behavior_logprobs "
                f"({len(self.behavior_logprobs)}) must have the same length"
            )
        if any(m not in (0, 1) for m in self.target_mask):
            raise ValueError("target_mask values must be 0 or 1")
        _check_logprobs("behavior_logprobs", self.behavior_logprobs)
        if any(lp != 0.0 for lp, m in zip(self.behavior_logprobs, self.target_mask, strict=True) if not m):
            raise ValueError("behavior_logprobs must be 0.0 where target_mask is 0")
        last = 0
        for span in self.weight_versions:
            if span.start < last or span.end > n:
                raise ValueError("weight_versions spans must be ordered, disjoint and inside token_ids")
            last = span.end
        in_spans = sum(sum(self.target_mask[s.start : s.end]) for s in self.weight_versions)
        if in_spans != sum(self.target_mask):
            raise ValueError(
                "every target token must lie inside a weight_versions span (a recorded output token)"
            )
        if self.temperatures is not None:
            if len(self.temperatures) != n:
                raise ValueError(f"temperatures has length {len(self.temperatures)}, token_ids has {n}")
            for t, m in zip(self.temperatures, self.target_mask, strict=True):
                if (m and not (math.isfinite(t) and t > 0)) or (not m and t != 0.0):
                    raise ValueError("temperatures must be > 0 where target_mask is 1 and 0.0 elsewhere")
        if self.placeholder:
            if any(self.target_mask):
                raise ValueError("a placeholder trajectory has no targets")
        elif self.leaf_call_id is None:
            raise ValueError("leaf_call_id is required unless placeholder is true")
        return self

    @property
    def num_targets(self) -> int:
        return sum(self.target_mask)
