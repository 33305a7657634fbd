"""Anthropic Messages API: request parsing into a `Conversation`, responses, SSE events and errors.

Unknown request fields are ignored. Content blocks: text, image (rendered as a placeholder), tool_use, tool_result
(string or blocks, `is_error`), thinking / redacted_thinking. Mid-conversation `role: "system"` messages are kept as
system turns. Volatile system lines (Claude Code's billing header) are removed before rendering.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from gyre_tito.conversation import (
    Conversation,
    Reply,
    Sampling,
    ToolCall,
    Turn,
    common_prefix,
    strip_volatile,
)
from gyre_tito.errors import ProtocolError

__all__ = [
    "error_body",
    "parse_request",
    "response_body",
    "sse_content",
    "sse_error",
    "sse_events",
    "sse_message_start",
    "sse_ping",
]

_STOP = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(400, "invalid_request_error", msg)


def _text_of(content: Any, where: str) -> str:
    """Text of a string or a list of blocks (text kept, images as placeholders)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of blocks")
    parts: list[str] = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _bad(f"{where}.content.{j}: a block must be an object with a type")
        if b["type"] == "text":
            if not isinstance(b.get("text"), str):
                raise _bad(f"{where}.content.{j}.text: must be a string")
            parts.append(b["text"])
        elif b["type"] in ("image", "document"):
            parts.append(f"[{b['type']}]")
    return "\n".join(parts)


def _system_text(system: Any, volatile_patterns) -> tuple[str | None, list[str]]:
    if system is None:
        return None, []
    if isinstance(system, str):
        blocks = [system]
    elif isinstance(system, list):
        blocks = []
        for j, b in enumerate(system):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise _bad(f"system.{j}: must be a text block")
            blocks.append(b["text"])
    else:
        raise _bad("system: must be a string or a list of text blocks")
    kept: list[str] = []
    removed: list[str] = []
    for b in blocks:
        text, gone = strip_volatile(b, volatile_patterns)
        removed.extend(gone)
        if text.strip():
            kept.append(text)
    return ("\n\n".join(kept) if kept else None), removed


def _turns_of(i: int, msg: Any) -> list[Turn]:
    where = f"messages.{i}"
    if not isinstance(msg, dict):
        raise _bad(f"{where}: must be an object")
    role = msg.get("role")
    content = msg.get("content")
    if role not in ("user", "assistant", "system"):
        raise _bad(f"{where}.role: must be 'user' or 'assistant', got {role!r}")
    if role == "system":
        return [Turn("system", _text_of(content, where))]
    if isinstance(content, str):
        return [Turn(role, content)]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: must be a string or a list of blocks")
    if role == "assistant":
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        for j, b in enumerate(content):
            if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                raise _bad(f"{where}.content.{j}: a block must be an object with a type")
            t = b["type"]
            if t == "text":
                if not isinstance(b.get("text"), str):
                    raise _bad(f"{where}.content.{j}.text: must be a string")
                texts.append(b["text"])
            elif t == "thinking":
                thinking.append(str(b.get("thinking", "")))
            elif t == "tool_use":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise _bad(f"{where}.content.{j}: tool_use needs string id and name")
                inp = b.get("input", {})
                if not isinstance(inp, dict):
                    raise _bad(f"{where}.content.{j}.input: must be an object")
                calls.append(ToolCall(b["id"], b["name"], inp))
        return [Turn("assistant", "\n".join(texts), "\n".join(thinking) or None, calls)]
    # user: tool results become tool turns (in order), the rest one user turn after them
    turns: list[Turn] = []
    rest: list[str] = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _bad(f"{where}.content.{j}: a block must be an object with a type")
        if b["type"] == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"{where}.content.{j}.tool_use_id: must be a string")
            text = _text_of(b.get("content"), f"{where}.content.{j}")
            turns.append(Turn("tool", text, tool_call_id=b["tool_use_id"]))
        elif b["type"] == "text":
            if not isinstance(b.get("text"), str):
                raise _bad(f"{where}.content.{j}.text: must be a string")
            rest.append(b["text"])
        elif b["type"] in ("image", "document"):
            rest.append(f"[{b['type']}]")
    if rest or not turns:
        turns.append(Turn("user", "\n".join(rest)))
    return turns


def parse_request(
    body: Any, volatile_patterns, cache: dict[bytes, list[Turn]] | None = None
) -> tuple[Conversation, Sampling, bool]:
    """Validate a /v1/messages body; returns the conversation, sampling settings and whether to stream.

    `cache` memoises parsed messages by their JSON bytes: a harness resends its whole history on every call, and
    only the new messages need parsing."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    for key in ("model", "max_tokens", "messages"):
        if key not in body:
            raise _bad(f"{key}: Field required")
    if not isinstance(body["model"], str):
        raise _bad("model: must be a string")
    mt = body["max_tokens"]
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise _bad("max_tokens: must be a positive integer")
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: must be a non-empty list")
    system, removed = _system_text(body.get("system"), volatile_patterns)
    # The messages the cache's last request also had, in the same place, keep their parsed turns (the same Turn
    # objects, which lets the encoder find its unchanged prefix by identity, incremental.py): one C-level comparison
    # of the message lists instead of serialising every message to look it up.
    prefix = getattr(cache, "prefix", None)  # (messages, turns, turns after message i) of the last request
    start = common_prefix(msgs, prefix[0]) if prefix else 0
    turns: list[Turn] = prefix[1][: prefix[2][start - 1]] if start else []
    turns_at: list[int] = prefix[2][:start] if start else []
    for i in range(start, len(msgs)):
        m = msgs[i]
        if cache is None:
            turns.extend(_turns_of(i, m))
            continue
        key = orjson.dumps(m)
        got = cache.get(key)
        if got is None:
            got = cache[key] = _turns_of(i, m)
            if len(cache) > 100_000:  # bounded: drop the oldest half
                for k in list(cache)[:50_000]:
                    del cache[k]
        turns.extend(got)
        turns_at.append(len(turns))
    if turns[-1].role == "assistant":
        raise _bad("messages: the last message must be a user message (assistant prefill is not supported)")
    tools = []
    for j, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _bad(f"tools.{j}: needs a string name")
        if "input_schema" not in tool:  # server tools (web_search, ...) have no schema; not renderable
            continue
        fn = {
            "name": tool["name"],
            "description": tool.get("description", ""),
            "parameters": tool["input_schema"],
        }
        tools.append({"type": "function", "function": fn})
    sampling = Sampling(max_new_tokens=mt)
    for key, attr, typ in (
        ("temperature", "temperature", float),
        ("top_p", "top_p", float),
        ("top_k", "top_k", int),
    ):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise _bad(f"{key}: must be a number")
            setattr(sampling, attr, typ(v))
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop_sequences: must be a list of strings")
    sampling.stop = stops
    thinking = body.get("thinking")
    enable = None
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        enable = False
    conv = Conversation(system, turns, tools, removed, enable)
    conv.check_tool_results(turns_at[start - 1] if start else 0)  # the kept turns passed this check last time
    if hasattr(cache, "prefix"):
        cache.prefix = (msgs, turns, turns_at)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: must be a boolean")
    return conv, sampling, stream


def _blocks(r: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if r.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.text or (not r.tool_calls and r.reasoning is None):
        blocks.append({"type": "text", "text": r.text})
    for c in r.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments})
    return blocks


def _stop_reason(r: Reply) -> str:
    if r.tool_calls and r.finish == "stop":
        return "tool_use"
    return _STOP.get(r.finish, "end_turn")


def response_body(r: Reply) -> dict[str, Any]:
    return {
        "id": r.id,
        "type": "message",
        "role": "assistant",
        "model": r.model,
        "content": _blocks(r),
        "stop_reason": _stop_reason(r),
        "stop_sequence": r.stop_sequence,
        "usage": {"input_tokens": r.input_tokens, "output_tokens": r.output_tokens},
    }


def _frame(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _chunks(s: str, n: int = 48) -> list[str]:
    return [s[i : i + n] for i in range(0, len(s), n)] or [""]


def sse_message_start(msg_id: str, model: str, input_tokens: int) -> bytes:
    """`message_start`: sent as soon as the call is accepted (before generation ends)."""
    start = {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 1},
    }
    return _frame("message_start", {"type": "message_start", "message": start})


def sse_ping() -> bytes:
    return _frame("ping", {"type": "ping"})


def sse_error(kind: str, message: str) -> bytes:
    """An error after the stream has started (the HTTP status is already 200)."""
    return _frame("error", error_body(kind, message))


def sse_events(r: Reply) -> Iterator[bytes]:
    """The exact event sequence of a streamed Messages response for an already generated reply."""
    yield sse_message_start(r.id, r.model, r.input_tokens)
    yield from sse_content(r)


def sse_content(r: Reply) -> Iterator[bytes]:
    """Everything after `message_start`: the content blocks, `message_delta` and `message_stop`."""
    for i, b in enumerate(_blocks(r)):
        if b["type"] == "thinking":
            yield _frame(
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": b | {"thinking": ""}},
            )
            for piece in _chunks(b["thinking"]):
                delta = {"type": "thinking_delta", "thinking": piece}
                yield _frame(
                    "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
                )
            sig = {"type": "signature_delta", "signature": b["signature"]}
            yield _frame("content_block_delta", {"type": "content_block_delta", "index": i, "delta": sig})
        elif b["type"] == "text":
            yield _frame(
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
            )
            for piece in _chunks(b["text"]):
                delta = {"type": "text_delta", "text": piece}
                yield _frame(
                    "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
                )
        else:
            cb = b | {"input": {}}
            yield _frame(
                "content_block_start", {"type": "content_block_start", "index": i, "content_block": cb}
            )
            for piece in _chunks(orjson.dumps(b["input"]).decode()):
                delta = {"type": "input_json_delta", "partial_json": piece}
                yield _frame(
                    "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
                )
        yield _frame("content_block_stop", {"type": "content_block_stop", "index": i})
    yield _frame(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(r), "stop_sequence": r.stop_sequence},
            "usage": {"output_tokens": r.output_tokens},
        },
    )
    yield _frame("message_stop", {"type": "message_stop"})
