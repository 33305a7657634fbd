"""Synthetic call records and sessions, for tests, benchmarks and examples (no proxy, no engine).

- ``make_record(...)``: a valid ``CallRecord`` with sensible defaults (deterministic logprobs, one output segment).
- ``SessionDriver(tree_or_records)``: does what the proxy does for each call: match the full context against the tree,
  record the incremental input under the matched node, append. ``call(context, output, ...)`` returns the stored
  record; ``driver.context(call_id)`` is the context + output a harness would continue from.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from gyre_tito.records import ExecutionRecords
from gyre_tito.tree import ExecutionTree, as_tokens
from gyre_tito.types import CallRecord, OutputSegment, RoleClass, Timings, runs_from_mask

__all__ = ["SessionDriver", "lcg_tokens", "make_record"]


def _default_logprobs(output_ids: Sequence[int]) -> list[float]:
    # Deterministic, distinct, finite and <= 0: easy to check alignment in tests.
    return [-((t % 97) + 1) / 100.0 for t in output_ids]


def make_record(
    *,
    execution_id: str = "ex",
    call_id: str,
    seq: int = 0,
    parent_id: str | None = None,
    input_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
    output_logprobs: Sequence[float] | None = None,
    input_policy: Sequence[bool] | None = None,
    role_class: RoleClass = "main/task",
    agent_id: str = "main",
    call_kind: str | None = None,
    engine_id: str = "engine-0",
    weight_version: str = "0",
    segments: Sequence[OutputSegment] | None = None,
    finish_reason: str = "stop",
    t: float = 0.0,
) -> CallRecord:
    output_ids = list(output_ids)
    if segments is None and output_ids:
        segments = [
            OutputSegment(engine_id=engine_id, weight_version=weight_version, start=0, end=len(output_ids))
        ]
    return CallRecord(
        execution_id=execution_id,
        call_id=call_id,
        seq=seq,
        parent_id=parent_id,
        input_ids=list(input_ids),
        input_provenance=runs_from_mask(
            input_policy if input_policy is not None else [False] * len(input_ids)
        ),
        output_ids=output_ids,
        output_logprobs=list(output_logprobs)
        if output_logprobs is not None
        else _default_logprobs(output_ids),
        output_segments=list(segments or ()),
        agent_id=agent_id,
        role_class=role_class,
        call_kind=call_kind or ("summary" if role_class.endswith("summary") else "task"),
        finish_reason=finish_reason,
        timings=Timings(request_at=t, first_token_at=t, end_at=t),
    )


class SessionDriver:
    """Drive a tree the way the proxy does: match, record the incremental input, append."""

    def __init__(self, target: ExecutionTree | ExecutionRecords) -> None:
        self.target = target
        self.tree = target.tree if isinstance(target, ExecutionRecords) else target

    def call(
        self,
        context: Sequence[int] | array,
        output: Sequence[int],
        *,
        role_class: RoleClass = "main/task",
        agent_id: str = "main",
        weight_version: str = "0",
        call_id: str | None = None,
    ) -> CallRecord:
        ctx = as_tokens(context)
        parent, matched = self.tree.match(ctx)
        record = make_record(
            execution_id=self.tree.execution_id,
            call_id=call_id or f"c{len(self.tree)}",
            seq=len(self.tree),
            parent_id=parent,
            input_ids=ctx[matched:].tolist(),
            output_ids=output,
            role_class=role_class,
            agent_id=agent_id,
            weight_version=weight_version,
            t=float(len(self.tree)),
        )
        if isinstance(self.target, ExecutionRecords):
            return self.target.append(record)
        self.tree.add(record)
        return record

    def context(self, call_id: str) -> array:
        """Root-path tokens of ``call_id`` (its context followed by its output)."""
        return self.tree.path_tokens(call_id)


def lcg_tokens(seed: int, n: int, vocab: int = 50_000) -> list[int]:
    """``n`` pseudo-random token ids from a tiny LCG (fast, deterministic, no numpy)."""
    out = []
    x = seed & 0xFFFFFFFF
    for _ in range(n):
        x = (1103515245 * x + 12345) & 0x7FFFFFFF
        out.append(x % vocab)
    return out
