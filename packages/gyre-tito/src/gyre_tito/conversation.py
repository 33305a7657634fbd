"""Protocol-neutral conversation: what the Anthropic and OpenAI layers parse requests into, and what gets rendered.

`Conversation.template_messages(recorded_for)` produces the chat-template message list. `recorded_for(turn)` returns
an index into the recorded outputs when an assistant turn is one of our own recorded responses (recognised by the
tool-call payload cache: its tool-call ids, or its text), and that turn is rendered as a placeholder that the encoder
replaces by the recorded tokens verbatim (see `render.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre_tito.errors import ProtocolError
from gyre_tito.render import recorded_marker

__all__ = [
    "DEFAULT_VOLATILE_PATTERNS",
    "Conversation",
    "ProtocolError",
    "Reply",
    "Sampling",
    "ToolCall",
    "Turn",
    "append_template_message",
    "common_prefix",
    "strip_volatile",
]

# Claude Code's first system block is a per-version, per-agent billing line; it is metadata, not prompt content.
DEFAULT_VOLATILE_PATTERNS: tuple[str, ...] = (r"^x-anthropic-billing-header:[^\n]*\n?",)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Turn:
    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)


@dataclass
class Conversation:
    system: str | None
    turns: list[Turn]
    tools: list[dict[str, Any]]  # OpenAI function form: {"type": "function", "function": {...}}
    # text removed from the system prompt (kept as metadata)
    volatile: list[str] = field(default_factory=list)
    enable_thinking: bool | None = None

    def template_messages(self, recorded_for: Callable[[Turn], int | None]) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        for t in self.turns:
            append_template_message(msgs, t, recorded_for)
        return msgs

    def check_tool_results(self, start: int = 0) -> None:
        """Every tool result must answer a tool call of the latest assistant turn before it (as both APIs require).
        Turns before `start` are known to pass (the same turns of an earlier request)."""
        i = start - 1
        while i >= 0 and self.turns[i].role != "assistant":  # the calls still open at `start`
            i -= 1
        open_ids: set[str] = {c.id for c in self.turns[i].tool_calls} if i >= 0 else set()
        for i in range(start, len(self.turns)):
            t = self.turns[i]
            if t.role == "assistant":
                open_ids = {c.id for c in t.tool_calls}
            elif t.role == "tool" and t.tool_call_id not in open_ids:
                raise ProtocolError(
                    400,
                    "invalid_request_error",
                    f"messages: tool result at turn {i} refers to unknown tool call id {t.tool_call_id!r} "
                    "(no matching tool call in the preceding assistant message)",
                )


def append_template_message(
    msgs: list[dict[str, Any]], t: Turn, recorded_for: Callable[[Turn], int | None]
) -> None:
    """Append turn `t`'s chat-template message to `msgs` (nothing when it continues a recorded output already there)."""
    if t.role == "assistant":
        k = recorded_for(t)
        if k is not None:
            marker = recorded_marker(k)
            # one response split by the harness into consecutive assistant messages is spliced once
            if not (msgs and msgs[-1]["role"] == "assistant" and msgs[-1]["content"] == marker):
                msgs.append({"role": "assistant", "content": marker})
            return
        m: dict[str, Any] = {"role": "assistant", "content": t.content}
        if t.reasoning:
            m["reasoning_content"] = t.reasoning
        if t.tool_calls:
            m["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in t.tool_calls
            ]
        msgs.append(m)
    elif t.role == "tool":
        msgs.append({"role": "tool", "content": t.content, "tool_call_id": t.tool_call_id})
    else:
        msgs.append({"role": t.role, "content": t.content})


def common_prefix(a: list[Any], b: list[Any]) -> int:
    """Length of the common prefix of two lists, by C-level slice comparisons only: one when `b` is a prefix of `a`
    (a harness resending its history plus new messages), a binary search otherwise. Elements that are the same
    objects compare by identity, so a prefix of reused objects costs no element comparison at all."""
    k = min(len(a), len(b))
    if a[:k] == b[:k]:
        return k
    lo, hi = 0, k - 1  # a[:lo] == b[:lo] holds, a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def strip_volatile(text: str, patterns: tuple[str, ...] | list[str]) -> tuple[str, list[str]]:
    """Remove volatile lines (multi-line regexes) from system text; returns the kept text and what was removed."""
    removed: list[str] = []
    for pat in patterns:
        rx = re.compile(pat, re.M)
        removed.extend(m.group(0).rstrip("\n") for m in rx.finditer(text))
        text = rx.sub("", text)
    return text, removed


@dataclass
class Reply:
    """One generated answer, ready for either API layer to serialise."""

    id: str
    model: str
    reasoning: str | None
    text: str
    tool_calls: list[ToolCall]
    finish: str  # stop | length | stop_sequence
    stop_sequence: str | None
    input_tokens: int
    output_tokens: int
    logprobs: list[float] = field(default_factory=list)
    token_strings: list[str] = field(default_factory=list)
