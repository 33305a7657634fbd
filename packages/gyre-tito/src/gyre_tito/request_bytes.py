"""Parse a request body at the cost of its new bytes: a harness resends its whole history on every call.

At 128k tokens a Claude Code request is ~200-400 KB of JSON, of which a call adds a few KB (the last reply and a tool
result). Parsing all of it (`orjson.loads`) costs 0.3-0.5 ms per call and yields new objects for every message, which
the parser then compares with the last request's deeply (another 0.3 ms). Each execution instead keeps the last few
bodies it received (`RequestBytes`) with the byte offset where each element of their `messages` array ends. A new body
that starts with the same bytes up to the end of message k (one memcmp per probe, no copy) keeps messages 0..k as the
same objects; only the bytes after them are parsed, and the parser's prefix check then costs pointer comparisons.

Exactness: `load_request` returns what `orjson.loads` returns for the whole body (the same values and key order), and
raises orjson's own error for invalid JSON; anything it cannot prove (a duplicate top-level key, an element that is
not an object, a trailing comma, a body whose fields before `messages` changed) takes the whole parse instead.
`tests/test_request_bytes.py` checks both against each other on generated bodies.

Offsets come from a structural scan of the new bytes only: a regular expression steps over whole JSON strings (in C),
so Python sees one match per bracket and per string, not per byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["RequestBytes", "RequestHistory", "load_request"]

# A JSON string (escapes included) or one bracket; in valid JSON nothing else can hold a bracket.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)
_WS = b" \t\n\r"
_OPEN = frozenset(b"{[")
_QUOTE, _COLON, _COMMA, _LBRACKET, _RBRACKET, _LBRACE, _RBRACE = b'":,[]{}'


@dataclass(frozen=True, slots=True)
class RequestBytes:
    """One parsed body and where its parts lie: `raw[:ends[i]]` ends with message i."""

    raw: bytes
    ends: list[int]
    close: int  # offset of the `]` closing `messages`
    before: dict[str, Any]  # the top-level fields before `messages`
    messages: list[Any]
    after: dict[str, Any]  # the top-level fields after `messages`

    def body(self) -> dict[str, Any]:
        return {**self.before, "messages": self.messages, **self.after}


class RequestHistory:
    """The last bodies of one execution: two, since agents take turns in one (Claude Code's main agent and the
    sub-agent it waits for). Each holds its raw bytes (~3 bytes per context token)."""

    __slots__ = ("keep", "recent")

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.recent: list[RequestBytes] = []

    def remember(self, state: RequestBytes) -> None:
        self.recent = [state, *(r for r in self.recent if r is not state)][: self.keep]


def _skip_ws(raw: bytes, pos: int) -> int:
    n = len(raw)
    while pos < n and raw[pos] in _WS:
        pos += 1
    return pos


def _elements(raw: bytes, pos: int) -> tuple[list[int], int] | None:
    """Scan array elements from `pos` (just inside `[` or after a `,`): the end offset of each (all objects) and the
    offset of the closing `]`; None if an element is not an object or the brackets do not close."""
    ends: list[int] = []
    depth = 0
    expect_object = True
    for m in _TOKEN.finditer(raw, pos):
        c = raw[m.start()]
        if c == _QUOTE:
            if depth == 0:
                return None  # a string element
            continue
        if c in _OPEN:
            if depth == 0 and (c != _LBRACE or not expect_object):
                return None
            depth += 1
            continue
        depth -= 1
        if depth == 0:
            ends.append(m.end())
            expect_object = False
            nxt = _skip_ws(raw, m.end())
            if nxt < len(raw) and raw[nxt] == _COMMA:
                expect_object = True
        elif depth < 0:
            return (ends, m.start()) if c == _RBRACKET else None
    return None


def _parse_after(raw: bytes, close: int) -> dict[str, Any] | None:
    """The top-level fields after `messages`' closing bracket (orjson parses them); None when they are not a
    well-formed rest of an object."""
    pos = _skip_ws(raw, close + 1)
    if pos >= len(raw):
        return None
    if raw[pos] == _RBRACE:
        return {} if not raw[pos + 1 :].strip(_WS) else None
    if raw[pos] != _COMMA:
        return None
    key = _skip_ws(raw, pos + 1)
    if key >= len(raw) or raw[key] != _QUOTE:
        return None
    try:
        after = orjson.loads(b"{" + raw[key:])
    except orjson.JSONDecodeError:
        return None
    return after if "messages" not in after else None


def _cold(raw: bytes) -> tuple[dict[str, Any], RequestBytes | None]:
    """The whole parse; the state for the next body when the top level is plain (unique keys, `messages` a list of
    objects)."""
    body = orjson.loads(raw)
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return body, None
    start = _skip_ws(raw, 0)
    if raw[start] != _LBRACE:
        return body, None
    keys: list[str] = []
    depth, pos = 0, start
    for m in _TOKEN.finditer(raw, start):
        c = raw[m.start()]
        if c == _QUOTE:
            if depth == 1:
                nxt = _skip_ws(raw, m.end())
                if raw[nxt] == _COLON:  # a top-level key
                    tok = m.group()
                    keys.append(tok[1:-1].decode() if b"\\" not in tok else orjson.loads(tok))
                    if keys[-1] == "messages":
                        pos = _skip_ws(raw, nxt + 1)
                        break
            continue
        depth += 1 if c in _OPEN else -1
    if not keys or keys[-1] != "messages" or len(set(keys)) != len(keys) or raw[pos] != _LBRACKET:
        return body, None
    scanned = _elements(raw, pos + 1)
    if scanned is None or not scanned[0] or len(scanned[0]) != len(body["messages"]):
        return body, None
    ends, close = scanned
    after = _parse_after(raw, close)
    if after is None or any(key in after for key in keys):
        return body, None  # a key twice: orjson keeps its first place and its last value
    before = {k: body[k] for k in keys[:-1]}
    after = {k: body[k] for k in after}  # the returned objects: a next body reuses them
    return body, RequestBytes(raw, ends, close, before, body["messages"], after)


def _kept(raw: bytes, last: RequestBytes) -> int:
    """Messages of `last` that `raw` repeats byte for byte from its start (0 when not even the first)."""
    view = memoryview(last.raw)
    n = len(last.ends)

    def same(k: int) -> bool:  # messages 0..k-1 and everything before them
        return raw.startswith(view[: last.ends[k - 1]])

    for k in (
        n,
        n - 1,
    ):  # the usual cases: all of them, or all but the last (Claude Code moves its cache mark)
        if k > 0 and same(k):
            return k
    lo, hi = 0, n - 2  # same(lo) holds (or lo is 0), same(hi + 1) does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if same(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _warm(raw: bytes, last: RequestBytes, k: int) -> tuple[dict[str, Any], RequestBytes] | None:
    pos = _skip_ws(raw, last.ends[k - 1])
    if pos >= len(raw):
        return None
    if raw[pos] == _RBRACKET:
        ends, close, new = last.ends[:k], pos, []
    elif raw[pos] == _COMMA:
        scanned = _elements(raw, pos + 1)
        if scanned is None or not scanned[0]:
            return None
        ends, close = last.ends[:k] + scanned[0], scanned[1]
        try:
            new = orjson.loads(b"[" + raw[pos + 1 : close] + b"]")
        except orjson.JSONDecodeError:
            return None
        if len(new) != len(scanned[0]):
            return None
    else:
        return None
    if raw[close:] == last.raw[last.close :]:
        after = last.after  # the same bytes after `messages` (system, tools, ...): the same values
    else:
        after = _parse_after(raw, close)
        if after is None or any(key in last.before for key in after):
            return None
    state = RequestBytes(raw, ends, close, last.before, last.messages[:k] + new, after)
    return state.body(), state


def load_request(raw: bytes, history: RequestHistory | None = None) -> dict[str, Any] | Any:
    """`orjson.loads(raw)`, parsing only what no recent body of `history` had (see the module docstring)."""
    if history is None:
        return orjson.loads(raw)
    best, kept = None, 0
    for last in history.recent:
        k = _kept(raw, last) if raw.startswith(memoryview(last.raw)[: last.ends[0]]) else 0
        if k > kept:
            best, kept = last, k
    if best is not None:
        warm = _warm(raw, best, kept)
        if warm is not None:
            history.remember(warm[1])
            return warm[0]
    body, state = _cold(raw)
    if state is not None:
        history.remember(state)
    return body
