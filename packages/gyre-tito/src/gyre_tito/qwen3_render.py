"""A native Python renderer with the semantics of the Qwen3 chat template (see `tiny_tokenizer.QWEN3_CHAT_TEMPLATE`).

Jinja costs ~25 us per message, which makes rendering the main cost of a call at long contexts (hundreds of messages).
`ChatTokenizer` uses this renderer only when it reproduces the tokenizer's own template byte for byte on a set of
probe conversations (`PROBES`: tools or not, system or not, mid-conversation system turns, tool calls with dict or
string arguments, merged tool results, reasoning before and after the last user query, the generation prompt with
thinking on and off); any other template is rendered by jinja.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PROBES",
    "qwen3_chunk",
    "qwen3_generation_prompt",
    "qwen3_head",
    "qwen3_last_query",
    "qwen3_stable",
    "render_qwen3",
]

_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)


def _dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)


def qwen3_head(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> str:
    """The system block: tools and/or a first system message (depends on nothing else)."""
    first_system = bool(messages) and messages[0]["role"] == "system"
    if tools:
        out = ["<|im_start|>system\n"]
        if first_system:
            out.append(messages[0]["content"] + "\n\n")
        out.append(_TOOLS_HEAD)
        for t in tools:
            out.append("\n" + _dumps(t))
        out.append(_TOOLS_TAIL)
        return "".join(out)
    if first_system:
        return "<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n"
    return ""


def qwen3_last_query(messages: Sequence[dict[str, Any]], start: int = 0) -> int:
    """Index of the last real user query (not a tool response) at or after `start`, -1 if none; assistant
    reasoning is kept only after it (after the last message when there is none)."""
    for i in range(len(messages) - 1, start - 1, -1):
        m = messages[i]
        c = m.get("content")
        if (
            m["role"] == "user"
            and isinstance(c, str)
            and not (c.startswith("<tool_response>") and c.endswith("</tool_response>"))
        ):
            return i
    return -1


def qwen3_chunk(messages: Sequence[dict[str, Any]], i: int, last_query: int) -> str:
    """Message i's part of the render. It depends on message i, on whether its neighbours are tool results, on
    whether it is the last message, and (assistant turns) on `last_query`; `qwen3_stable` says which chunks a longer
    conversation leaves unchanged."""
    n = len(messages)
    m = messages[i]
    role = m["role"]
    c = m.get("content")
    content = c if isinstance(c, str) else ""
    if role == "user" or (role == "system" and i != 0):
        return "<|im_start|>" + role + "\n" + content + "<|im_end|>\n"
    out: list[str] = []
    if role == "assistant":
        rc = m.get("reasoning_content")
        reasoning = ""
        if isinstance(rc, str):
            reasoning = rc
        elif "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if i > last_query and (i == n - 1 or reasoning):
            out.append(
                "<|im_start|>assistant\n<think>\n"
                + reasoning.strip("\n")
                + "\n</think>\n\n"
                + content.lstrip("\n")
            )
        else:
            out.append("<|im_start|>assistant\n" + content)
        for j, tc in enumerate(m.get("tool_calls") or []):
            if j > 0 or content:
                out.append("\n")
            if tc.get("function"):
                tc = tc["function"]
            args = tc["arguments"]
            out.append('<tool_call>\n{"name": "' + str(tc["name"]) + '", "arguments": ')
            out.append(args if isinstance(args, str) else _dumps(args))
            out.append("}\n</tool_call>")
        out.append("<|im_end|>\n")
    elif role == "tool":
        if i == 0 or messages[i - 1]["role"] != "tool":
            out.append("<|im_start|>user")
        out.append("\n<tool_response>\n" + content + "\n</tool_response>")
        if i == n - 1 or messages[i + 1]["role"] != "tool":
            out.append("<|im_end|>\n")
    return "".join(out)


def qwen3_stable(old_n: int, old_last_query: int, new_last_query: int) -> int:
    """How many leading chunks of an `old_n`-message render stay the same when messages are appended: all but the
    old last one (its `i == n - 1` and next-is-tool cases change), and none after the earlier of the two last
    queries when the last query moved (their reasoning is kept or dropped)."""
    stable = max(old_n - 1, 0)
    if new_last_query != old_last_query:
        stable = min(stable, min(old_last_query, new_last_query) + 1)
    return stable


def qwen3_generation_prompt(add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> str:
    if not add_generation_prompt:
        return ""
    return "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if enable_thinking is False else "")


def render_qwen3(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    **_: Any,
) -> str:
    last_query = qwen3_last_query(messages)
    if last_query < 0:
        last_query = len(messages) - 1
    parts = [qwen3_head(messages, tools)]
    parts.extend(qwen3_chunk(messages, i, last_query) for i in range(len(messages)))
    parts.append(qwen3_generation_prompt(add_generation_prompt, enable_thinking))
    return "".join(parts)


_T = [
    {
        "type": "function",
        "function": {"name": "Bash", "description": "Run ü", "parameters": {"type": "object"}},
    }
]
_CALL = {"type": "function", "function": {"name": "Bash", "arguments": {"command": "ls ü", "n": 1}}}
_SCALL = {"id": "c1", "type": "function", "function": {"name": "Read", "arguments": '{"file_path": "a"}'}}
_CONV = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "<think>\nr0\n</think>\n\nanswer0"},
    {"role": "user", "content": "q2"},
    {"role": "system", "content": "mid system"},
    {"role": "assistant", "content": "", "tool_calls": [_CALL, _SCALL]},
    {"role": "tool", "content": "out1"},
    {"role": "tool", "content": "out2"},
    {"role": "assistant", "content": "text", "reasoning_content": "r1", "tool_calls": [_CALL]},
    {"role": "tool", "content": "out3"},
    {"role": "assistant", "content": "<think>\nr2\n</think>\n\nfinal"},
]
# (messages, tools, kwargs) triples: the renderer must match the template on every one
PROBES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = [
    (_CONV, _T, {"add_generation_prompt": True}),
    (_CONV, None, {"add_generation_prompt": False}),
    (_CONV[1:], _T, {"add_generation_prompt": True, "enable_thinking": False}),
    (_CONV[1:4], None, {"add_generation_prompt": True, "enable_thinking": True}),
    (
        [{"role": "user", "content": "<tool_response>x</tool_response>"}, _CONV[2]],
        _T,
        {"add_generation_prompt": True},
    ),
    (
        [{"role": "tool", "content": "t"}, {"role": "user", "content": "u"}],
        None,
        {"add_generation_prompt": True},
    ),
]
