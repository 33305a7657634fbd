"""Which weight transport a process can use: Mooncake where its engine loads, else HTTP from the publisher.

Mooncake's native library links against `libibverbs.so.1` even for TCP, so a machine with only Python and uv
cannot import it. `mooncake_problem()` tries the import in a child interpreter (this process never loads the
native library, and a broken import leaves nothing behind in it) and returns why it failed, or None; `choose()`
turns a configured `auto` into the transport actually used, with one line to say so when it falls back.

Torch-free: the run's controller and `gyre config` import it.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import Literal, NamedTuple

from .mooncake import INSTALL_HINT

__all__ = ["Choice", "choose", "install_hint", "mooncake_problem"]

Transport = Literal["mooncake", "http"]

PROBE = "import mooncake.engine"
PROBE_TIMEOUT_S = 120.0
"""An import takes well under a second; a machine under heavy load may need much longer."""


@functools.cache
def mooncake_problem(python: str | None = None) -> str | None:
    """None when `import mooncake.engine` succeeds in a child interpreter (`python`, default this one), else its
    error's last line (e.g. `ImportError: libibverbs.so.1: cannot open shared object file: ...`). Once per
    process: the machine's libraries do not change during a run."""
    try:
        proc = subprocess.run(
            [python or sys.executable, "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"`{PROBE}` did not finish within {PROBE_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"cannot start {python or sys.executable}: {exc.strerror}"
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"`{PROBE}` exited with status {proc.returncode}"


def install_hint(problem: str) -> str:
    """What to install for Mooncake, given why it did not load."""
    if "libibverbs" in problem:
        return "apt-get install libibverbs1"
    return INSTALL_HINT


class Choice(NamedTuple):
    """The outcome of `choose`: the transport, and the line that says why it is not Mooncake (None when it is)."""

    transport: Transport
    note: str | None


def choose(problem: str | None) -> Choice:
    """`auto` resolved: Mooncake when `problem` (from `mooncake_problem`) is None, else HTTP with one line naming
    the cause and the fix."""
    if problem is None:
        return Choice("mooncake", None)
    short = problem if len(problem) <= 160 else problem[:157] + "..."
    return Choice(
        "http",
        f"weights: Mooncake cannot load here ({short}); the core publishes weights and snapshots over HTTP "
        f"instead (for Mooncake: {install_hint(problem)})",
    )
