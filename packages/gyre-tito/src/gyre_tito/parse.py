"""Parse a model's raw output text (Qwen3 / Hermes format) into reasoning, text and tool calls.

Format: an optional `<think>\\n...\\n</think>\\n\\n` prefix, then text, then zero or more
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, then the end token. A tool-call block that is
not valid JSON (or has no name) stays text, so a malformed generation is shown to the harness rather than lost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedOutput", "ParsedToolCall", "parse_output"]

_TOOL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str  # the JSON text exactly as generated


@dataclass
class ParsedOutput:
    reasoning: str | None = None
    text: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def parse_output(raw: str) -> ParsedOutput:
    """Split a decoded generation (special tokens kept) into its parts."""
    s = raw
    for end in _END_TOKENS:  # the stop token closes the turn; it is not content
        if s.endswith(end):
            s = s[: -len(end)]
            break
    out = ParsedOutput()
    if "</think>" in s:
        head, s = s.split("</think>", 1)
        out.reasoning = head.split("<think>", 1)[-1].strip("\n")
        s = s.lstrip("\n")
    elif s.lstrip().startswith("<think>"):  # truncated inside reasoning
        out.reasoning = s.lstrip()[len("<think>") :].strip("\n")
        return out
    first_call = None
    for m in _TOOL_RE.finditer(s):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"_raw": args}
        if not isinstance(args, dict):
            args = {"value": args}
        out.tool_calls.append(ParsedToolCall(name=obj["name"], arguments=args, raw=m.group(1)))
        if first_call is None:
            first_call = m.start()
    out.text = (s[:first_call] if first_call is not None else s).strip()
    return out
