"""Role classification of model calls (docs/design/tito.md#provenance-mask-and-selection): which agent made a call and for what purpose.

API summary
-----------
- ``RoleInfo(agent_id, role_class, call_kind)``: a NamedTuple, so ``agent_id, role_class, call_kind = info`` works.
- ``RoleClassifier``: the plug-in protocol, ``classify(request, headers=None) -> RoleInfo``. ``request`` is the request
  body as the proxy received it (Anthropic Messages shape: ``system``, ``messages``, ``tools``, ...; OpenAI Chat
  Completions bodies work with ``StaticClassifier``); ``headers`` are the HTTP headers, for plug-ins that need them
  (the Claude Code default reads the body only).
- ``ClaudeCodeClassifier``: the default for Claude Code (signals below). ``StaticClassifier``: one fixed answer
  (default ``main/task``), for single-agent harnesses. ``make_classifier(name)`` builds one by name
  (``"claude-code"``, ``"static"``); ``CLASSIFIERS`` lists the names.

Claude Code signals (observed on 2.1.197, see shared/reference/claude-code.md; the CLI's text changes between versions,
so each signal is a constant of the classifier config and is tested on requests of that shape):

1. *Summary (compaction) call*: the last ``user`` message contains a text block that begins with
   ``"CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."`` and asks for a summary (mentions "summar").
   Compaction keeps the agent's system prompt and tools, so the agent is identified the same way as for task calls.
2. *Sub-agent* (spawned through the ``Agent`` tool): the first system block is the billing line
   ``x-anthropic-billing-header: ...`` and contains ``cc_is_subagent=`` (any value except false/0), or the request has
   an ``x-claude-code-agent-id`` header (sent only by sub-agents), or the system text contains
   ``"You are an agent for Claude Code"``.
3. *Side call* (title generation, topic detection, ...): not a summary call and no ``tools`` -> ``other``
   (``call_kind="side"``, ``agent_id="side"``). Every agent turn of Claude Code carries its tool list.
4. Everything else with tools is the main agent.

``agent_id`` is ``"main"`` for the main agent and ``"sub-<id>"`` for a sub-agent, ``<id>`` being the value of its
``x-claude-code-agent-id`` header (the id the main agent's Agent tool result names; stable for that sub-agent's whole
conversation, compactions included). Without the header it falls back to ``sub-<12 hex>``, a hash of the sub-agent's
first user message (its prompt; changes after a sub-agent compaction). Selection uses only ``role_class``.

The default was checked against requests the real CLI sent (tests/data/claude_code_2.1.197_requests.json: two
sub-agents and a forced compaction).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from gyre_tito.types import ROLE_CLASSES, RoleClass

__all__ = [
    "CLASSIFIERS",
    "ClaudeCodeClassifier",
    "ClaudeCodeSignals",
    "RoleClassifier",
    "RoleInfo",
    "StaticClassifier",
    "make_classifier",
]


class RoleInfo(NamedTuple):
    agent_id: str
    role_class: RoleClass
    call_kind: str


@runtime_checkable
class RoleClassifier(Protocol):
    def classify(self, request: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> RoleInfo: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaudeCodeSignals:
    compaction_prefix: str = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."
    """a text block of the last user message starting with this marks a compaction (summary) request"""
    compaction_keyword: str = "summar"
    """...and the block must also mention this (case-insensitive): the request asks for a summary"""
    billing_prefix: str = "x-anthropic-billing-header:"
    """the first system block of every Claude Code request starts with this"""
    subagent_flag: str = "cc_is_subagent="
    """present in the billing line of sub-agent requests"""
    subagent_system_markers: tuple[str, ...] = ("You are an agent for Claude Code",)
    """system text of sub-agents (general-purpose agent type)"""
    agent_id_header: str = "x-claude-code-agent-id"
    """HTTP header carrying a sub-agent's id (absent on main-agent requests)"""


def _text_of(content: Any) -> list[str]:
    """Text pieces of a message ``content`` (string or list of blocks); non-text blocks are skipped."""
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    if isinstance(content, list):
        for block in content:
            if (
                isinstance(block, Mapping)
                and block.get("type") == "text"
                and isinstance(block.get("text"), str)
            ):
                out.append(block["text"])
    return out


def _system_texts(request: Mapping[str, Any]) -> list[str]:
    return _text_of(request.get("system"))


def _user_messages(request: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = request.get("messages")
    if not isinstance(messages, list):
        return []
    return [m for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]


def _flag_value(line: str, flag: str) -> str:
    rest = line.split(flag, 1)[1]
    return rest.split(";", 1)[0].strip().lower()


@dataclass(frozen=True, kw_only=True, slots=True)
class ClaudeCodeClassifier:
    """Default classifier for Claude Code requests (rules in the module docstring)."""

    signals: ClaudeCodeSignals = ClaudeCodeSignals()
    """the text markers the rules look for"""

    def is_summary(self, request: Mapping[str, Any]) -> bool:
        users = _user_messages(request)
        if not users:
            return False
        s = self.signals
        for text in _text_of(users[-1].get("content")):
            body = text.lstrip()
            if body.startswith(s.compaction_prefix) and s.compaction_keyword in body.lower():
                return True
        return False

    def is_subagent(self, request: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> bool:
        s = self.signals
        if _header(headers, s.agent_id_header):
            return True
        system = _system_texts(request)
        if system and system[0].lstrip().startswith(s.billing_prefix):
            first_line = system[0].lstrip().split("\n", 1)[0]
            if s.subagent_flag in first_line and _flag_value(first_line, s.subagent_flag) not in (
                "false",
                "0",
            ):
                return True
        return any(marker in text for text in system for marker in s.subagent_system_markers)

    def classify(self, request: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> RoleInfo:
        summary = self.is_summary(request)
        if not summary and not request.get("tools"):
            return RoleInfo("side", "other", "side")
        purpose = "summary" if summary else "task"
        if self.is_subagent(request, headers):
            header_id = _header(headers, self.signals.agent_id_header)
            agent_id = f"sub-{header_id}" if header_id else _subagent_id(request)
            return RoleInfo(agent_id, f"sub/{purpose}", purpose)  # type: ignore[arg-type]
        return RoleInfo("main", f"main/{purpose}", purpose)  # type: ignore[arg-type]


def _header(headers: Mapping[str, str] | None, name: str) -> str | None:
    """Case-insensitive header lookup (plain dicts and framework header objects alike)."""
    if not headers:
        return None
    name = name.lower()
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == name and value:
            return str(value).strip() or None
    return None


def _subagent_id(request: Mapping[str, Any]) -> str:
    users = _user_messages(request)
    first = "\n".join(_text_of(users[0].get("content"))) if users else ""
    return "sub-" + hashlib.sha256(first.encode()).hexdigest()[:12]


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticClassifier:
    """Every call gets the same answer (single-agent harnesses, OpenAI-compatible agents)."""

    agent_id: str = "main"
    """agent id given to every call"""
    role_class: RoleClass = "main/task"
    """role class given to every call"""
    call_kind: str = "task"
    """call kind given to every call"""

    def __post_init__(self) -> None:
        if self.role_class not in ROLE_CLASSES:
            raise ValueError(f"unknown role class {self.role_class!r}; expected one of {ROLE_CLASSES}")

    def classify(self, request: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> RoleInfo:
        return RoleInfo(self.agent_id, self.role_class, self.call_kind)


CLASSIFIERS: dict[str, Callable[[], RoleClassifier]] = {
    "claude-code": ClaudeCodeClassifier,
    "static": StaticClassifier,
}


def make_classifier(name: str) -> RoleClassifier:
    """A classifier by name (``CLASSIFIERS``); a clear error naming the choices otherwise."""
    try:
        return CLASSIFIERS[name]()
    except KeyError:
        raise ValueError(f"unknown role classifier {name!r}; choose one of {sorted(CLASSIFIERS)}") from None
