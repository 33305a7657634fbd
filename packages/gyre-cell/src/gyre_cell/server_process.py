"""An engine server's process as a cell worker owns it (SGLang's, vLLM's): started so that it dies with the thread
that started it, stopped with a grace period (with what it started, for a server in a session of its own)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time

__all__ = ["die_with_parent", "stop_process"]

try:  # loaded before any fork: the child calls it without importing anything (threads may hold the import lock)
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not Linux
    _prctl = None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In the server's child before exec: send it `sig` when the thread that started it ends (a killed cell worker
    leaves no server holding the GPU). SIGKILL for a server whose subprocesses watch their parent themselves
    (SGLang's); SIGTERM for one whose subprocesses outlive a killed parent (vLLM's engine core and workers did, each
    holding its memory): its own shutdown then ends them."""
    if _prctl is not None:
        _prctl(1, int(sig))  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen | None, timeout_s: float, *, group: bool = False) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; nothing if it is not running. `group`: the process leads a session
    of its own (`start_new_session`), and whatever of that group is left once it has stopped is killed too."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
            for _ in range(200):  # SIGKILL lands at once, but the group is gone only once each one has exited
                os.killpg(proc.pid, 0)  # raises ProcessLookupError when none is left
                time.sleep(0.01)
