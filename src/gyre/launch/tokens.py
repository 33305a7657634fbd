"""Per-run service tokens and how they reach the run's children: a pipe handed over as an inherited fd.

`gyre run` makes three fresh tokens per run: the engines' API key (cell workers and standalone engines), gyre-eval's
service token and the proxy's admin token. The controller keeps them in memory only and gives each child the ones
it needs as the read end of a pipe (`--...-fd N`), already written and closed on this side, which the child reads
to its end and closes. Nothing is written to disk, the environment or argv: /proc/PID/environ and /proc/PID/cmdline
of every process of this user (an agent's Bash tool among them) would show those, and a file in the run directory
would be readable by any harness that runs as this user without a sandbox.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

__all__ = ["RunTokens", "TokenPipes"]


@dataclass(frozen=True, repr=False)
class RunTokens:
    """Fresh for every run (never reused across runs, never logged: `repr` hides them)."""

    engine: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    eval: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    admin: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    def __repr__(self) -> str:
        return "RunTokens(<hidden>)"

    def values(self) -> tuple[str, str, str]:
        return (self.engine, self.eval, self.admin)


class TokenPipes:
    """Read ends of pipes that hold one token each, for `subprocess.Popen(..., pass_fds=pipes.fds)`.

    `arg(flag, token)` returns `[flag, "N"]` for the child's argv (the fd number, never the token); `close()` (after
    the child started) closes this side's copies so the pipes live only in the child.
    """

    def __init__(self) -> None:
        self.fds: list[int] = []

    def arg(self, flag: str, token: str) -> list[str]:
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, token.encode() + b"\n")  # far below a pipe's buffer: never blocks
        finally:
            os.close(write_end)
        self.fds.append(read_end)
        return [flag, str(read_end)]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
