"""Harness adapters: how one execution's harness process is started, behind one interface.

A harness gets a `HarnessContext` (its workspace, the task prompt, the proxy's base URL, the execution's own
credential, the model name) and answers with the argv and the environment variables of its process. The runner adds
nothing else to that environment but the allow-listed variables of its own (``runner.DEFAULT_ENV_ALLOW``), so a
harness never sees the proxy's admin token or any other credential.

Adapters (``make_harness(spec)``; ``spec`` is a name or ``{"kind": NAME, ...options}``, chosen per run or per task):

- ``builtin`` (alias ``openai-agent``): Gyre's built-in OpenAI-compatible agent (``python -m gyre.demo.agent``) with
  ``OPENAI_BASE_URL`` = proxy/v1 and ``OPENAI_API_KEY`` = the credential.
- ``command``: any argv template; ``{workspace}``, ``{task}``, ``{base_url}``, ``{model}`` are substituted; the base
  URL and key are passed as ``OPENAI_BASE_URL`` (proxy/v1) / ``OPENAI_API_KEY`` and ``ANTHROPIC_BASE_URL`` /
  ``ANTHROPIC_API_KEY``.
- ``claude-code``: the pinned Claude Code CLI (``binary``, default ``node_modules/.bin/claude`` of the repository) in
  ``-p`` mode with ``ANTHROPIC_BASE_URL`` and the execution's key, the model name (``--model`` and every model
  slot), the tool allow-list (``--allowedTools``), optionally the tools the model is offered at all (``--tools``:
  the full set is 24 tools, ~47k prompt tokens of a byte-level BPE; four of them keep the real prompt at ~7k),
  ``--max-turns`` and the output-token cap
  (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``); telemetry, auto-update and nonessential traffic off; ``HOME`` is a private
  folder next to the workspace (``<workspace>.home``), so no host settings or credentials are read.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "HARNESSES",
    "BuiltinHarness",
    "ClaudeCodeHarness",
    "CommandHarness",
    "Harness",
    "HarnessContext",
    "make_harness",
]


@dataclass(frozen=True, slots=True)
class HarnessContext:
    """What one execution's harness is started with."""

    execution_id: str
    workspace: Path
    task: str
    base_url: str
    """The proxy's base URL, without ``/v1``."""
    credential: str
    """The execution's own key: the only credential the harness gets."""
    model: str = "gyre-policy"


@runtime_checkable
class Harness(Protocol):
    name: str

    def argv(self, ctx: HarnessContext) -> list[str]: ...

    def env(self, ctx: HarnessContext) -> dict[str, str]: ...


def _subst(template: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """Substitute ``{name}`` for the known names in one pass (a task holding ``{workspace}`` stays as it is)."""
    import re

    pattern = re.compile(r"\{(" + "|".join(map(re.escape, values)) + r")\}")
    return [pattern.sub(lambda m: values[m[1]], arg) for arg in template]


def _values(ctx: HarnessContext) -> dict[str, str]:
    return {"workspace": str(ctx.workspace), "task": ctx.task, "base_url": ctx.base_url, "model": ctx.model}


@dataclass(frozen=True)
class CommandHarness:
    """Any command: an argv template; the proxy's base URL and the execution's key as environment variables."""

    command: Sequence[str]
    extra_env: Mapping[str, str] = field(default_factory=dict)
    name: str = "command"

    def __post_init__(self) -> None:
        if (
            isinstance(self.command, str)
            or not self.command
            or not all(isinstance(a, str) for a in self.command)
        ):
            raise ValueError(f"command must be a non-empty list of strings, got {self.command!r}")

    def argv(self, ctx: HarnessContext) -> list[str]:
        return _subst(self.command, _values(ctx))

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {
            **self.extra_env,
            "OPENAI_BASE_URL": f"{ctx.base_url}/v1",
            "OPENAI_API_KEY": ctx.credential,
            "ANTHROPIC_BASE_URL": ctx.base_url,
            "ANTHROPIC_API_KEY": ctx.credential,
        }


@dataclass(frozen=True)
class BuiltinHarness:
    """Gyre's built-in agent (OpenAI Chat Completions with tools), as ``python -m gyre.demo.agent``."""

    python: str = sys.executable
    max_turns: int = 8
    max_tokens: int = 256
    temperature: float = 1.0
    extra_args: Sequence[str] = ()
    name: str = "builtin"

    def argv(self, ctx: HarnessContext) -> list[str]:
        return [
            self.python,
            "-m",
            "gyre.demo.agent",
            "--workspace",
            str(ctx.workspace),
            "--task",
            ctx.task,
            "--max-turns",
            str(self.max_turns),
            "--max-tokens",
            str(self.max_tokens),
            "--temperature",
            str(self.temperature),
            *self.extra_args,
        ]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"OPENAI_BASE_URL": f"{ctx.base_url}/v1", "OPENAI_API_KEY": ctx.credential}


def _default_claude() -> str:
    for parent in Path(__file__).resolve().parents:
        cand = parent / "node_modules" / ".bin" / "claude"
        if cand.exists():
            return str(cand)
    return "claude"


@dataclass(frozen=True)
class ClaudeCodeHarness:
    """The pinned Claude Code CLI against the proxy, with the execution's own key."""

    binary: str = field(default_factory=_default_claude)
    allowed_tools: Sequence[str] = ("Bash", "Read", "Write", "Edit", "Glob", "Grep")
    tools: Sequence[str] | None = None
    """``--tools``: the built-in tools the model is offered (None: the CLI's default set)."""
    max_turns: int = 30
    max_output_tokens: int | None = None
    output_format: str = "json"
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    """Further variables (e.g. ``CLAUDE_CODE_AUTO_COMPACT_WINDOW``); the proxy's address and key are always ours."""
    name: str = "claude-code"

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")

    def argv(self, ctx: HarnessContext) -> list[str]:
        return [
            self.binary,
            "-p",
            ctx.task,
            "--model",
            ctx.model,
            "--allowedTools",
            " ".join(self.allowed_tools),
            "--max-turns",
            str(self.max_turns),
            "--output-format",
            self.output_format,
            *(["--tools", ",".join(self.tools)] if self.tools is not None else []),
            *self.extra_args,
        ]

    def home(self, ctx: HarnessContext) -> Path:
        return ctx.workspace.with_name(ctx.workspace.name + ".home")

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        home = self.home(ctx)
        home.mkdir(parents=True, exist_ok=True)
        env = {
            **self.extra_env,
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": ctx.base_url,
            "ANTHROPIC_API_KEY": ctx.credential,
            "ANTHROPIC_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": ctx.model,
            "ANTHROPIC_SMALL_FAST_MODEL": ctx.model,
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        if self.max_output_tokens is not None:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(self.max_output_tokens)
        return env


HARNESSES: dict[str, type] = {
    "builtin": BuiltinHarness,
    "openai-agent": BuiltinHarness,
    "command": CommandHarness,
    "claude-code": ClaudeCodeHarness,
}


def make_harness(spec: str | Mapping[str, Any] | Harness) -> Harness:
    """A harness from its name or ``{"kind": NAME, ...options}`` (an adapter instance is returned as is)."""
    if isinstance(spec, Harness):
        return spec
    if isinstance(spec, str):
        spec = {"kind": spec}
    opts = dict(spec)
    kind = opts.pop("kind", None)
    if kind not in HARNESSES:
        raise ValueError(f"harness kind {kind!r}: must be one of {', '.join(sorted(HARNESSES))}")
    try:
        return HARNESSES[kind](**opts)
    except TypeError as e:
        raise ValueError(f"harness {kind!r}: {e}") from None
