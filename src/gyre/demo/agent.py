"""The built-in agent harness: a small OpenAI-compatible tool-calling agent, run as a black box.

Gyre treats every harness as a black box that talks to the TITO proxy over HTTP; this one exists so that `gyre demo`
and the CPU end-to-end tests have a harness that needs no network and no npm. It is deliberately an ordinary agent:
it keeps the conversation as messages (not tokens), sends the tools on every call, executes tool calls inside its
workspace and appends the results, and stops when the model answers without a tool call or the turn limit is reached.
That final answer is written to `answer.txt` in the workspace: the artifact the evaluator scores (no answer within
the turn limit: no file).

Context reset: when the conversation's text has grown by more than `context_chars` since the context started, the
agent starts a new conversation holding the task and its notes (every tool call so far with its result) instead of
the full history, as long-horizon harnesses compact their context. The proxy sees a context that extends none of the recorded ones:
the execution's tree gets a second branch from the root, and J_max selection a second trajectory to choose.

It needs only the standard library, so it starts in a few tens of milliseconds:
`python -I -S .../gyre/agent.py --workspace DIR --task TEXT` (or `python -m gyre.demo.agent ...`) with `OPENAI_BASE_URL`
(…/v1) and `OPENAI_API_KEY` (the execution's credential) in the environment. Exit status 0 = finished, 2 = usage,
3 = the model endpoint refused or failed. The conversation loop (`run_conversation`) takes any `complete` function,
so the demo policy's synthetic pre-training transcripts come from this same code.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "SYSTEM_PROMPT",
    "TOOLS",
    "AgentConfig",
    "AgentResult",
    "compact",
    "context_size",
    "main",
    "run_agent",
    "run_conversation",
    "run_tool",
]

SYSTEM_PROMPT = "You are a careful agent. Use the tools, then answer."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List the workspace files.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a workspace file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]
NOTES_HEADER = "Notes from earlier turns:"


def _inside(workspace: Path, relative: str) -> Path:
    target = (workspace / relative).resolve()
    if not target.is_relative_to(workspace.resolve()):
        raise ValueError(f"path {relative!r} leaves the workspace")
    return target


def run_tool(workspace: Path, name: str, arguments: str | dict) -> str:
    """Execute one tool call; errors become tool results (the model sees them), never crashes."""
    try:
        args = json.loads(arguments or "{}") if isinstance(arguments, str) else dict(arguments)
        if not isinstance(args, dict):
            raise TypeError("arguments must be a JSON object")
        if name == "list_files":
            root = workspace.resolve()
            names = sorted(
                str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "answer.txt"
            )
            return " ".join(names) if names else "(no files)"
        if name == "read_file":
            return _inside(workspace, str(args["path"])).read_text(errors="replace")[:4000]
        return f"error: unknown tool {name!r}"
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return f"error: {exc}"


def _arguments(call: dict) -> str:
    args = call.get("function", {}).get("arguments", "")
    return args if isinstance(args, str) else json.dumps(args)


def context_size(messages: list[dict]) -> int:
    """Characters of the conversation after the system prompt: contents plus tool-call names and arguments."""
    size = 0
    for m in messages[1:]:
        size += len(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            size += len(call.get("function", {}).get("name", "")) + len(_arguments(call))
    return size


def note(name: str, arguments: str, result: str) -> str:
    """One tool call and its result as the notes of a context reset keep it."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        args = {}
    shown = " ".join(str(v) for v in args.values()) if isinstance(args, dict) else ""
    return f"[{name} {shown}]".replace(" ]", "]") + "\n" + result.strip()


def compact(task: str, notes: list[str]) -> list[dict]:
    """The conversation a context reset starts: the system prompt, then the task with the notes."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{task}\n\n{NOTES_HEADER}\n" + "\n".join(notes)},
    ]


class AgentResult:
    """What one conversation did. A plain class, as is `AgentConfig`: `dataclasses` (it imports `inspect`) was a
    quarter of the CPU an agent process spends (33 of 146 ms, measured under load), and a run starts one per
    execution."""

    __slots__ = ("answer", "calls", "resets", "tool_calls", "transcript")

    def __init__(self) -> None:
        self.calls = 0
        """Model calls made."""
        self.answer: str | None = None
        """The final reply (None: the turn limit came first)."""
        self.resets = 0
        """Context resets."""
        self.tool_calls = 0
        """Tool calls executed."""
        self.transcript: list[tuple[list[dict], dict]] = []
        """(messages sent, assistant message received) per model call, when recorded."""


Complete = Callable[[list[dict]], dict]
"""Sends the conversation (with TOOLS) to the model; returns the assistant message (OpenAI shape)."""


def run_conversation(
    complete: Complete,
    workspace: Path,
    task: str,
    max_turns: int,
    context_chars: int = 0,
    record: bool = False,
) -> AgentResult:
    """Run the conversation to the end (answer or turn limit); writes answer.txt when the model answered."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]
    notes: list[str] = []
    result = AgentResult()
    base = context_size(messages)  # what the current context started with (the task, then the task and notes)
    for _ in range(max_turns):
        if context_chars and notes and context_size(messages) - base > context_chars:
            messages = compact(task, notes)
            base = context_size(messages)
            result.resets += 1
        message = complete(messages)
        if record:
            result.transcript.append(([dict(m) for m in messages], message))
        result.calls += 1
        content = message.get("content") or ""
        tool_calls = message.get("tool_calls") or []
        messages.append(
            {"role": "assistant", "content": content, "tool_calls": tool_calls}
            if tool_calls
            else {"role": "assistant", "content": content}
        )
        if not tool_calls:
            result.answer = content
            break
        for call in tool_calls:
            name, arguments = call.get("function", {}).get("name", ""), _arguments(call)
            output = run_tool(workspace, name, arguments)
            result.tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})
            notes.append(note(name, arguments, output))
    if result.answer is not None:
        (workspace / "answer.txt").write_text(result.answer)
    return result


class AgentConfig:
    """Where and how one execution talks to its model (a plain class: see `AgentResult`)."""

    __slots__ = (
        "api_key",
        "base_url",
        "context_chars",
        "max_tokens",
        "max_turns",
        "model",
        "temperature",
        "timeout_s",
        "workspace",
    )

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        workspace: Path,
        max_turns: int = 6,
        max_tokens: int = 40,
        temperature: float = 1.0,
        context_chars: int = 0,
        model: str = "gyre-policy",
        timeout_s: float = 600.0,
    ) -> None:
        self.base_url = base_url
        """OpenAI-compatible base URL ending in /v1 (the TITO proxy)."""
        self.api_key = api_key
        """The execution's credential; it identifies the execution to the proxy."""
        self.workspace = workspace
        """Directory the agent may read; its answer.txt is the scored artifact."""
        self.max_turns = max_turns
        """Model calls before the agent gives up (without an answer)."""
        self.max_tokens = max_tokens
        """max_tokens per model call."""
        self.temperature = temperature
        """Sampling temperature (training rollouts sample at the trainer's temperature)."""
        self.context_chars = context_chars
        """Reset the context (task + notes) when the conversation has grown by this many characters; 0: never."""
        self.model = model
        """Model name sent in requests (the proxy serves one policy)."""
        self.timeout_s = timeout_s
        """Per-request timeout."""


class EndpointError(RuntimeError):
    """The model endpoint refused the request or could not be reached."""


def http_complete(config: AgentConfig) -> Complete:
    """`complete` over HTTP: POST {base_url}/chat/completions with the execution's credential."""
    url = urllib.parse.urlsplit(config.base_url.rstrip("/") + "/chat/completions")
    if url.scheme not in ("http", "https") or not url.hostname:
        raise EndpointError(f"the model endpoint must be an http(s) URL, not {config.base_url!r}")
    target = url.path + (f"?{url.query}" if url.query else "")
    headers = {"Authorization": f"Bearer {config.api_key}", "Content-Type": "application/json"}
    tls = []  # one TLS context per agent, made on its first https call (plain http, the proxy's usual: none)

    def connection() -> http.client.HTTPConnection:
        # http.client, not urllib: urlopen's default opener builds a TLS context with the system's certificates
        # even for plain http, about a quarter of a short agent's CPU (py-spy, gyre demo)
        if url.scheme == "http":
            return http.client.HTTPConnection(url.hostname, url.port or 80, timeout=config.timeout_s)
        if not tls:
            import ssl

            tls.append(ssl.create_default_context())
        return http.client.HTTPSConnection(
            url.hostname, url.port or 443, timeout=config.timeout_s, context=tls[0]
        )

    def complete(messages: list[dict]) -> dict:
        body = {
            "model": config.model,
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": config.max_tokens,
            "temperature": config.temperature,
        }
        conn = None
        try:
            conn = connection()
            conn.request("POST", target, json.dumps(body).encode(), headers)
            response = conn.getresponse()
            data = response.read()
            if response.status >= 400:
                raise EndpointError(f"{response.status} {data[:500].decode(errors='replace')}")
            return json.loads(data)["choices"][0]["message"]
        except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError) as exc:
            raise EndpointError(str(exc)) from exc
        finally:
            if conn is not None:
                conn.close()

    return complete


def run_agent(config: AgentConfig, task: str) -> AgentResult:
    """One execution against the endpoint in `config`."""
    return run_conversation(
        http_complete(config), config.workspace, task, config.max_turns, config.context_chars
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre.demo.agent", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--context-chars", type=int, default=0)
    args = parser.parse_args(argv)
    base_url = os.environ.get("OPENAI_BASE_URL")
    api_key = os.environ.get("OPENAI_API_KEY")
    if not base_url or not api_key:
        print("gyre.demo.agent: OPENAI_BASE_URL and OPENAI_API_KEY must be set", file=sys.stderr)
        return 2
    config = AgentConfig(
        base_url=base_url,
        api_key=api_key,
        workspace=args.workspace,
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        context_chars=args.context_chars,
    )
    try:
        result = run_agent(config, args.task)
    except EndpointError as exc:
        print(f"gyre.demo.agent: model endpoint failed: {exc}", file=sys.stderr)
        return 3
    print(
        json.dumps(
            {
                "model_calls": result.calls,
                "tool_calls": result.tool_calls,
                "resets": result.resets,
                "answered": result.answer is not None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
