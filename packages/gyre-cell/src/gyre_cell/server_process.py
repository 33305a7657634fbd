"""An engine server's process as a cell worker owns it (SGLang's, vLLM's): started so that it dies with the thread
that started it, stopped with a grace period."""

from __future__ import annotations

import ctypes
import subprocess

__all__ = ["die_with_parent", "stop_process"]

try:  # loaded before any fork: the child calls it without importing anything (threads may hold the import lock)
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not Linux
    _prctl = None


def die_with_parent() -> None:
    """In the server's child before exec: SIGKILL it when the thread that started it ends (a killed cell worker leaves
    no server holding the GPU). Its own subprocesses watch their parent themselves."""
    if _prctl is not None:
        _prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


def stop_process(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; nothing if it is not running."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
