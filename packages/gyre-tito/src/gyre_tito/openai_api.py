"""OpenAI Chat Completions: request parsing into a `Conversation`, responses, streaming chunks and errors.

Messages: system/developer, user (string or content parts), assistant (content, `tool_calls` with JSON-string
arguments, optional `reasoning_content`), tool (`tool_call_id`). Logprobs (`logprobs`, `top_logprobs`) report the
engine's sampled-token log-probs; top alternatives are not requested from the engine, so `top_logprobs` is empty.
"""

from __future__ import annotations

import json
import time
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
    "KEEPALIVE",
    "error_body",
    "parse_request",
    "response_body",
    "stream_chunks",
    "stream_error",
    "stream_role_chunk",
]

_FINISH = {"stop": "stop", "length": "length", "stop_sequence": "stop"}


def error_body(kind: str, message: str, status: int) -> dict[str, Any]:
    code = {401: "invalid_api_key", 404: "not_found"}.get(status)
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(400, "invalid_request_error", msg)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content: must be a string or a list of content parts")
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict):
            raise _bad(f"{where}.content.{j}: must be an object")
        if p.get("type") == "text":
            if not isinstance(p.get("text"), str):
                raise _bad(f"{where}.content.{j}.text: must be a string")
            parts.append(p["text"])
        else:
            parts.append(f"[{p.get('type', 'part')}]")
    return "\n".join(parts)


def _turn(i: int, m: Any) -> Turn:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(f"{where}: must be an object")
    role = m.get("role")
    if role in ("system", "developer"):
        return Turn("system", _text(m.get("content"), where))
    if role == "user":
        return Turn("user", _text(m.get("content"), where))
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise _bad(f"{where}.tool_call_id: required for tool messages")
        return Turn("tool", _text(m.get("content"), where), tool_call_id=m["tool_call_id"])
    if role == "assistant":
        calls = []
        for j, c in enumerate(m.get("tool_calls") or []):
            fn = c.get("function") if isinstance(c, dict) else None
            if (
                not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not isinstance(c.get("id"), str)
            ):
                raise _bad(f"{where}.tool_calls[{j}]: needs id and function.name")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise _bad(f"{where}.tool_calls[{j}].function.arguments: not valid JSON ({e})") from e
            if not isinstance(args, dict):
                raise _bad(f"{where}.tool_calls[{j}].function.arguments: must encode a JSON object")
            calls.append(ToolCall(c["id"], fn["name"], args))
        reasoning = m.get("reasoning_content")
        return Turn(
            "assistant",
            _text(m.get("content"), where),
            reasoning if isinstance(reasoning, str) else None,
            calls,
        )
    raise _bad(f"{where}.role: unsupported role {role!r}")


def parse_request(
    body: Any, volatile_patterns, cache: Any = None
) -> tuple[Conversation, Sampling, bool, dict[str, Any]]:
    """Validate a /v1/chat/completions body; returns conversation, sampling, stream flag and output options.

    `cache` (an execution's `TurnCache`) keeps the last request's messages and their turns: the messages a new body
    repeats as the same objects (`request_bytes.load_request`) keep their `Turn`s, which lets the encoder find its
    unchanged prefix by identity (incremental.py)."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: must be a non-empty list")
    if not isinstance(body.get("model"), str):
        raise _bad("model: required string")
    prefix = getattr(cache, "chat_prefix", None)
    start = common_prefix(msgs, prefix[0]) if prefix else 0
    turns = prefix[1][:start] if start else []
    turns.extend(_turn(i, msgs[i]) for i in range(start, len(msgs)))
    if cache is not None:
        cache.chat_prefix = (msgs, list(turns))
    system = None
    removed: list[str] = []
    if turns[0].role == "system":
        system, removed = strip_volatile(turns.pop(0).content, volatile_patterns)
    tools = []
    for j, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict) or "name" not in t["function"]:
            raise _bad(f"tools[{j}]: must be {{'type': 'function', 'function': {{'name': ...}}}}")
        tools.append({"type": "function", "function": t["function"]})
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is None:
        mt = 1024
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise _bad("max_completion_tokens: must be a positive integer")
    sampling = Sampling(max_new_tokens=mt)
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise _bad(f"{key}: must be a number")
            setattr(sampling, key, float(v))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise _bad("stop: must be a string or a list of strings")
    sampling.stop = stop or []
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: must be a boolean")
    if body.get("n", 1) not in (1, None):
        raise _bad("n: only n=1 is supported (each choice would be a separate recorded call)")
    so = body.get("stream_options") or {}
    opts = {
        "logprobs": bool(body.get("logprobs")),
        "include_usage": bool(so.get("include_usage")) if isinstance(so, dict) else False,
    }
    conv = Conversation(system or None, turns, tools, removed)
    conv.check_tool_results()
    return conv, sampling, stream, opts


def _finish(r: Reply) -> str:
    if r.tool_calls and r.finish == "stop":
        return "tool_calls"
    return _FINISH.get(r.finish, "stop")


def _logprobs(r: Reply) -> dict[str, Any]:
    return {
        "content": [
            {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            for s, lp in zip(r.token_strings, r.logprobs, strict=True)
        ],
        "refusal": None,
    }


def _calls(r: Reply) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in r.tool_calls
    ]


def response_body(r: Reply, opts: dict[str, Any]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": r.text if (r.text or not r.tool_calls) else None}
    if r.reasoning is not None:
        msg["reasoning_content"] = r.reasoning
    if r.tool_calls:
        msg["tool_calls"] = _calls(r)
    return {
        "id": r.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": r.model,
        "choices": [
            {
                "index": 0,
                "message": msg,
                "finish_reason": _finish(r),
                "logprobs": _logprobs(r) if opts.get("logprobs") else None,
            }
        ],
        "usage": {
            "prompt_tokens": r.input_tokens,
            "completion_tokens": r.output_tokens,
            "total_tokens": r.input_tokens + r.output_tokens,
        },
    }


def stream_role_chunk(msg_id: str, model: str) -> bytes:
    """The first chunk (`delta.role`), sent as soon as the call is accepted."""
    c = {
        "id": msg_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
                "logprobs": None,
            }
        ],
    }
    return b"data: " + orjson.dumps(c) + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic


def stream_error(kind: str, message: str, status: int) -> bytes:
    """An error after the stream has started, then the end of the stream."""
    return b"data: " + orjson.dumps(error_body(kind, message, status)) + b"\n\ndata: [DONE]\n\n"


def stream_chunks(r: Reply, opts: dict[str, Any], include_role: bool = True) -> Iterator[bytes]:
    """`data: {chunk}` frames of a streamed completion for an already generated reply, then `data: [DONE]`."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        c = {
            "id": r.id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": r.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }
        return b"data: " + orjson.dumps(c) + b"\n\n"

    if include_role:
        yield chunk({"role": "assistant", "content": ""})
    if r.reasoning is not None:
        yield chunk({"reasoning_content": r.reasoning})
    if r.text:
        lp = _logprobs(r) if opts.get("logprobs") else None
        yield chunk({"content": r.text}, logprobs=lp)
    elif opts.get("logprobs"):
        yield chunk({}, logprobs=_logprobs(r))
    for i, c in enumerate(_calls(r)):
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["function"]["name"], "arguments": ""},
                    }
                ]
            }
        )
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    yield chunk({}, finish=_finish(r))
    if opts.get("include_usage"):
        usage = {
            "prompt_tokens": r.input_tokens,
            "completion_tokens": r.output_tokens,
            "total_tokens": r.input_tokens + r.output_tokens,
        }
        c = {
            "id": r.id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": r.model,
            "choices": [],
            "usage": usage,
        }
        yield b"data: " + orjson.dumps(c) + b"\n\n"
    yield b"data: [DONE]\n\n"
