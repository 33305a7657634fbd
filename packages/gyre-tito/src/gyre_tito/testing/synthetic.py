"""Synthetic call records and sessions, for tests, benchmarks and examples (no proxy, no engine).

- ``make_record(...)``: a valid ``CallRecord`` with sensible defaults (deterministic logprobs, one output segment).
- ``SessionDriver(tree_or_records)``: does what the proxy does for each call: match the full context against the tree,
  record the incremental input under the matched node, append. ``call(context, output, ...)`` returns the stored
  record; ``driver.context(call_id)`` is the context + output a harness would continue from.
- ``long_session(LongSessionConfig(...)) -> list[ScriptedCall]``: a token-level Claude Code-like execution (main-agent
  epochs growing to ``max_context`` separated by compactions, sub-agent conversations); used by bench/tito_tree.py.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from gyre_tito.records import ExecutionRecords
from gyre_tito.tree import TOKEN_TYPECODE, ExecutionTree, as_tokens
from gyre_tito.types import CallRecord, OutputSegment, RoleClass, Timings, runs_from_mask

__all__ = ["LongSessionConfig", "ScriptedCall", "SessionDriver", "lcg_tokens", "long_session", "make_record"]


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


@dataclass(frozen=True, slots=True)
class ScriptedCall:
    """One call of a scripted session: the full context the harness sends and the engine's output."""

    context: array
    output: array
    role_class: RoleClass
    agent_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LongSessionConfig:
    calls: int = 300
    """total model calls (main task calls + compactions + sub-agent calls)"""
    max_context: int = 128_000
    """the main agent compacts when its next context would exceed this"""
    compactions: int = 2
    """main-agent compactions (epochs = compactions + 1)"""
    subagents: int = 3
    """sub-agent conversations, spread over the epochs"""
    sub_calls: int = 20
    """calls per sub-agent"""
    system_tokens: int = 20_000
    """main system prompt + tool schemas (Claude Code's are large)"""
    sub_system_tokens: int = 12_000
    """sub-agent system prompt + tools"""
    output_tokens: int = 300
    """tokens per task output"""
    summary_tokens: int = 2_000
    """tokens per compaction summary"""
    seed: int = 0
    """token ids come from a seeded random pool"""


def long_session(config: LongSessionConfig | None = None) -> list[ScriptedCall]:
    """A Claude Code-like execution at token level: main agent epochs growing to ``max_context`` separated by
    compactions (summary call, then a restart whose first user turn carries the summary), with sub-agent conversations
    (their own system prompt: new root branches) spawned through the main agent; side calls are not included."""
    c = config or LongSessionConfig()
    epochs = c.compactions + 1
    main_calls = c.calls - c.compactions - c.subagents * c.sub_calls
    if main_calls < epochs:
        raise ValueError("not enough calls for the main agent")
    per_epoch = [main_calls // epochs + (1 if e < main_calls % epochs else 0) for e in range(epochs)]
    subs_per_epoch = [c.subagents // epochs + (1 if e < c.subagents % epochs else 0) for e in range(epochs)]
    # Largest context = system + first user turn + every step + returned sub-agent answers + the compaction prompt.
    fixed = c.system_tokens + 100 + c.summary_tokens + max(subs_per_epoch) * c.output_tokens + 200
    step = max(c.output_tokens + 1, (c.max_context - fixed) // max(per_epoch))
    tool_tokens = step - c.output_tokens
    rng = random.Random(c.seed)
    pool_size = 4 * (epochs * c.max_context + c.subagents * (c.sub_system_tokens + c.sub_calls * step))
    pool = array(TOKEN_TYPECODE, array("H", rng.randbytes(2 * pool_size)))
    cursor = 0

    def fresh(n: int) -> array:
        nonlocal cursor
        if cursor + n > len(pool):
            raise ValueError("token pool exhausted; raise pool_size")
        cursor += n
        return pool[cursor - n : cursor]

    main_system, sub_system = fresh(c.system_tokens), fresh(c.sub_system_tokens)
    script: list[ScriptedCall] = []
    summary = None
    sub_index = 0
    for e in range(epochs):
        first_user = fresh(100) if summary is None else fresh(100) + summary
        ctx = main_system + first_user
        spawns = {(k + 1) * per_epoch[e] // (subs_per_epoch[e] + 1) for k in range(subs_per_epoch[e])}
        for k in range(per_epoch[e]):
            out = fresh(c.output_tokens)
            script.append(ScriptedCall(ctx, out, "main/task", "main"))
            tool_result = fresh(tool_tokens)
            if k in spawns:
                sub_ctx = sub_system + fresh(200)
                for _ in range(c.sub_calls):
                    sub_out = fresh(c.output_tokens)
                    script.append(ScriptedCall(sub_ctx, sub_out, "sub/task", f"sub-{sub_index}"))
                    sub_ctx = sub_ctx + sub_out + fresh(tool_tokens)
                tool_result = sub_out + tool_result  # the sub-agent's answer comes back as the tool result
                sub_index += 1
            ctx = ctx + out + tool_result
        if e < epochs - 1:
            summary = fresh(c.summary_tokens)
            script.append(ScriptedCall(ctx + fresh(200), summary, "main/summary", "main"))
    return script
