"""Per-execution proxy state: the execution (credential, tree, tool-call payload cache, route) and a prepared call."""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_tito.conversation import Conversation, Turn
from gyre_tito.incremental import EncodeState
from gyre_tito.records import ExecutionRecords
from gyre_tito.request_bytes import RequestHistory
from gyre_tito.types import CallRecord

__all__ = [
    "EndedExecution",
    "Execution",
    "PreparedCall",
    "QuarantinedExecution",
    "credential_hash",
    "text_key",
]


def text_key(text: str) -> str:
    """Key of a text-only reply in the payload cache (harnesses may trim surrounding whitespace)."""
    return hashlib.sha256(text.strip().encode()).hexdigest()[:32]


def credential_hash(credential: str) -> str:
    """Credentials are stored and compared as SHA-256 only."""
    return hashlib.sha256(credential.encode()).hexdigest()


class TurnCache(dict):
    """Parsed messages by their JSON bytes, for one execution: a harness resends its whole history on every call.

    Held by the execution, so it leaves memory when the execution ends; bounded by the bytes of its keys (oldest
    entries go first), so one execution sending ever new large messages cannot grow it without limit."""

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.prefix: tuple[list, list, list[int]] | None = None
        """The last request's (messages, turns, turn count after each message): an unchanged prefix is not
        parsed or looked up again (`anthropic_api.parse_request`)."""
        self.chat_prefix: tuple[list, list] | None = None
        """The same for the OpenAI chat API: the last request's (messages, the turn of each message)."""

    def __setitem__(self, key: bytes, value) -> None:
        if key in self:
            return
        if 2 * len(key) > self.max_bytes:
            return  # larger than half the budget: parse it again next time rather than keep it
        super().__setitem__(key, value)
        self.nbytes += 2 * len(key)  # the JSON bytes and the parsed text they hold
        while self.nbytes > self.max_bytes:
            old = next(iter(self))
            super().__delitem__(old)
            self.nbytes -= 2 * len(old)

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        self.nbytes -= 2 * len(key)


@dataclass
class Execution:
    """One registered execution: its record log + tree, and the payload cache that maps our responses back."""

    id: str
    group_id: str
    records: ExecutionRecords
    route: list[str] | None = None
    ended: bool = False
    tool_index: dict[str, str] = field(default_factory=dict)  # tool-call id we issued -> call id
    text_index: dict[str, str] = field(default_factory=dict)  # reply text key -> call id (text-only replies)
    gen_suffix: dict[str, str] = field(default_factory=dict)  # call id -> generation-prompt text after header
    metadata: dict[str, Any] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # guards tree reads against an append in flight
    turn_cache: TurnCache = field(default_factory=lambda: TurnCache())  # parsed messages (see anthropic_api)
    # its last few request bodies, parsed: the next one parses only its new bytes (request_bytes.py)
    request_history: RequestHistory = field(default_factory=RequestHistory)
    # the last request, encoded (incremental.py)
    encode_state: EncodeState = field(default_factory=EncodeState)
    inflight: int = 0  # calls between `Proxy.finish` start and end: an ended execution is unloaded only at 0
    # its calls' generations: `Proxy.end` cancels them
    serving: set[asyncio.Task] = field(default_factory=set)

    def recorded_call(self, t: Turn) -> str | None:
        """Call id of our recorded response that assistant turn `t` replays (tool-call payload cache), or None."""
        cid = next((self.tool_index[c.id] for c in t.tool_calls if c.id in self.tool_index), None)
        if cid is None and not t.tool_calls:
            cid = self.text_index.get(text_key(t.content))
        return cid if cid is not None and cid in self.records.tree else None

    def index(self, rec: CallRecord) -> None:
        for tid in rec.metadata.get("tool_call_ids", []):
            self.tool_index[tid] = rec.call_id
        if rec.metadata.get("text_key"):
            self.text_index[rec.metadata["text_key"]] = rec.call_id
        if rec.metadata.get("gen_suffix"):
            self.gen_suffix[rec.call_id] = rec.metadata["gen_suffix"]


@dataclass(slots=True)
class EndedExecution:
    """What stays in memory of an ended execution (a long run ends tens of thousands): no tree, no payload cache.

    Anything that needs the tree reloads it read-only from ``log_path`` (``Proxy.tree``)."""

    id: str
    group_id: str
    log_path: Path
    route: list[str] | None = None
    calls: int | None = None  # None after a restart until first asked for (counted from the log, not kept)
    ended: bool = True


@dataclass(slots=True)
class QuarantinedExecution:
    """An execution that could not be loaded at start (a damaged record log or registration). Its calls are refused
    with 403 and admin requests with 409, both naming the damage; the log is left byte for byte as it was, so it can
    be repaired (or inspected) and the proxy restarted. Every other execution is unaffected."""

    id: str
    group_id: str
    log_path: Path
    reason: str
    ended: bool = True

    def message(self) -> str:
        return (
            f"execution {self.id[:200]!r} is quarantined: {self.reason[:500]} "
            f"(log {self.log_path}; repair or remove it and restart the proxy)"
        )


@dataclass
class PreparedCall:
    """A validated, encoded and matched call, ready for the engine (see `Proxy.prepare`)."""

    ex: Execution
    conv: Conversation
    api: str
    meta: dict[str, Any]
    ids: array
    policy: bytearray
    parent: str | None
    n: int  # tokens of the context covered by the parent's path
    role: tuple[str, str, str]  # agent_id, role_class, call_kind
    sampling: dict[str, Any]
    msg_id: str
    t0: float
    accepted: asyncio.Event = field(default_factory=asyncio.Event)  # set once an engine accepted the request

    @property
    def input_tokens(self) -> int:
        return len(self.ids)
