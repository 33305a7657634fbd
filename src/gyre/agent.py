"""The built-in agent harness: a small OpenAI-compatible tool-calling agent, run as a black box.

Gyre treats every harness as a black box that talks to the TITO proxy over HTTP; this one exists so that `gyre demo`
and the CPU end-to-end tests have a harness that needs no network and no npm. It is deliberately an ordinary agent:
it keeps the conversation as messages (not tokens), sends the tools on every call, executes tool calls inside its
workspace and appends the results, and stops when the model answers without a tool call or the turn limit is reached.
Its final answer is written to `answer.txt` in the workspace: that file is the artifact the evaluator scores.

Run: `python -m gyre.agent --workspace DIR --task TEXT` with `OPENAI_BASE_URL` (…/v1) and `OPENAI_API_KEY` (the
execution's credential) in the environment. Exit status 0 = finished, 3 = the model endpoint refused or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]


@dataclass(frozen=True, slots=True)
class AgentConfig:
    base_url: str
    """OpenAI-compatible base URL ending in /v1 (the TITO proxy)."""
    api_key: str
    """The execution's credential; it identifies the execution to the proxy."""
    workspace: Path
    """Directory the agent may read and write; its answer.txt is the scored artifact."""
    max_turns: int = 4
    """Model calls before the agent gives up and submits what it has."""
    max_tokens: int = 48
    """max_tokens per model call."""
    temperature: float = 1.0
    """Sampling temperature (training rollouts sample at the trainer's temperature)."""
    model: str = "gyre-policy"
    """Model name sent in requests (the proxy serves one policy)."""


def _inside(workspace: Path, relative: str) -> Path:
    target = (workspace / relative).resolve()
    if not target.is_relative_to(workspace.resolve()):
        raise ValueError(f"path {relative!r} leaves the workspace")
    return target


def run_tool(workspace: Path, name: str, arguments: str) -> str:
    """Execute one tool call; errors become tool results (the model sees them), never crashes."""
    try:
        args = json.loads(arguments or "{}")
        if name == "write_file":
            path = _inside(workspace, str(args["path"]))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(args["content"]))
            return f"wrote {len(str(args['content']))} characters to {args['path']}"
        if name == "read_file":
            return _inside(workspace, str(args["path"])).read_text()[:4000]
        return f"error: unknown tool {name!r}"
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return f"error: {exc}"


def run_agent(config: AgentConfig, task: str) -> int:
    """Run the conversation to the end; returns the number of model calls made."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a careful agent. Use the tools, then answer."},
        {"role": "user", "content": task},
    ]
    headers = {"Authorization": f"Bearer {config.api_key}"}
    answer = ""
    calls = 0
    with httpx.Client(base_url=config.base_url, headers=headers, timeout=httpx.Timeout(600.0)) as client:
        for _ in range(config.max_turns):
            body = {
                "model": config.model,
                "messages": messages,
                "tools": TOOLS,
                "max_tokens": config.max_tokens,
                "temperature": config.temperature,
            }
            response = client.post("/chat/completions", json=body)
            calls += 1
            response.raise_for_status()
            message = response.json()["choices"][0]["message"]
            tool_calls = message.get("tool_calls") or []
            messages.append(
                {"role": "assistant", "content": message.get("content") or "", "tool_calls": tool_calls}
                if tool_calls
                else {"role": "assistant", "content": message.get("content") or ""}
            )
            answer = message.get("content") or answer
            if not tool_calls:
                break
            for call in tool_calls:
                result = run_tool(
                    config.workspace, call["function"]["name"], call["function"].get("arguments", "")
                )
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    (config.workspace / "answer.txt").write_text(answer)
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    base_url = os.environ.get("OPENAI_BASE_URL")
    api_key = os.environ.get("OPENAI_API_KEY")
    if not base_url or not api_key:
        print("gyre.agent: OPENAI_BASE_URL and OPENAI_API_KEY must be set", file=sys.stderr)
        return 2
    config = AgentConfig(
        base_url=base_url,
        api_key=api_key,
        workspace=args.workspace,
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )
    try:
        calls = run_agent(config, args.task)
    except httpx.HTTPError as exc:
        print(f"gyre.agent: model endpoint failed: {exc}", file=sys.stderr)
        return 3
    print(json.dumps({"model_calls": calls}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
