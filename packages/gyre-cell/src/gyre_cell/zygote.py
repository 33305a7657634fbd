"""Fork CPU cell workers from one process that has already imported what they need (a zygote).

A cell worker spends about 20 CPU-seconds importing torch, transformers and the model code before it does anything
else; three of them on a 2-core machine take 30-40 s to start. The zygote imports those once, then forks each worker
from that state, so a worker (and a restarted one) starts with everything imported.

- `Zygote.start(preload, env)` runs `python -m gyre_cell.zygote` in its own session; it dies with the thread that
  started it (PDEATHSIG: start it from the thread that lives as long as the run, the event loop's), and its children
  die with it. `wait_ready()` returns once its imports are done, or raises `ZygoteError` naming the one that failed.
- `spawn(entry, args, ...)` forks a child that runs `entry(args)` ("module:function", e.g. "gyre_cell.cli:main") in its
  own session, with the request's environment, working directory and log files, and returns a `ForkedProcess`: the
  part of `subprocess.Popen` a launcher uses (`pid`, `poll`, `wait`, `returncode`). The zygote reaps its children and
  reports each exit status the way Popen does (-N: killed by signal N).
- A child's process title is the command line it stands for (`title`): `ps` and /proc/PID/cmdline show it.
- Secrets travel inside the private socket pair and reach the child as an fd it reads (`secrets`: flag -> token adds
  `flag FD`), never through its environment or argv. /proc/PID/environ of a child shows the zygote's own start
  environment (`env` of `start`), so that must hold no secret either.

Only for workers on CPU: the zygote never touches CUDA, and a CUDA worker's start is dominated by CUDA and its
weights, not imports. Wire: JSON messages over an AF_UNIX SOCK_SEQPACKET pair, one message per packet.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from gyre_cell.errors import ZygoteError
from gyre_train.hf_import import import_transformers

__all__ = ["WORKER_MODULES", "ForkedProcess", "Zygote", "ZygoteError"]

WORKER_MODULES = (
    "gyre_cell.worker",
    "gyre_train.backends.torch_backend",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen3.modeling_qwen3",  # the built-in policy's; another model imports its own in the child
)
"""What a cell worker imports on its way to serving (`gyre_cell.worker` and what its engine and trainer load)."""

MAX_MESSAGE = 1 << 20
"""Largest request (a child's environment rides in it)."""


# ---- the zygote process ------------------------------------------------------------------------------------------
def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _resolve(entry: str) -> Callable[[list[str]], int | None]:
    module, _, func = entry.partition(":")
    return getattr(importlib.import_module(module), func)


def _child(req: dict, zygote: int, inherited: Sequence[int]) -> int | None:
    """In the forked child: become the process the request describes, then run its entry."""
    os.setsid()
    _die_with_parent(zygote)
    with contextlib.suppress(ImportError):  # before the environment changes: it takes over environ's memory
        import setproctitle

        setproctitle.setproctitle(req["title"])
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in inherited:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for target, path in ((1, req["stdout"]), (2, req["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    args = list(req["args"])
    for flag, token in req["secrets"]:
        read_end, write_end = os.pipe()
        os.write(write_end, token.encode() + b"\n")  # far below a pipe's buffer: never blocks
        os.close(write_end)
        args += [flag, str(read_end)]
    sys.argv = [req["title"].split(" ", 1)[0], *args]
    return _resolve(req["entry"])(args)


def _fork(req: dict, inherited: Sequence[int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    zygote = os.getpid()
    with warnings.catch_warnings():  # 3.12 warns on fork beside native threads (OpenBLAS's pool: fork-safe)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        result = _child(req, zygote, inherited)
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket, preload: Sequence[str]) -> int:
    """The zygote's loop: import `preload`, then fork a child per request until the socket closes."""
    for name in preload:
        try:
            if name.split(".")[0] == "transformers":  # its import skips the installed-files scan (hf_import)
                import_transformers()
            importlib.import_module(name)
        except BaseException as exc:  # reported to the launcher, which then starts workers plainly
            _send(sock, {"ready": False, "error": f"import {name}: {type(exc).__name__}: {exc}"})
            return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears of each exit
    signal.set_wakeup_fd(wake_w)
    _send(sock, {"ready": True, "pid": os.getpid()})
    inherited = (sock.fileno(), wake_r, wake_w)
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(sock)
        if sock not in readable:
            continue
        data = sock.recv(MAX_MESSAGE)
        if not data:  # the launcher is gone or done: leave; the children die with this process (PDEATHSIG)
            return 0
        req = json.loads(data)
        try:
            _send(sock, {"id": req["id"], "pid": _fork(req, inherited)})
        except OSError as exc:
            _send(sock, {"id": req["id"], "error": f"fork: {exc}"})


# ---- the launcher's side -----------------------------------------------------------------------------------------
class ForkedProcess:
    """A child of the zygote, seen like a `subprocess.Popen`; its exit status comes from the zygote."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _end(self, returncode: int) -> None:
        self.returncode = returncode
        self._ended.set()


class Zygote:
    """Handle on a running zygote; see the module docstring."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket) -> None:
        self._proc = proc
        self._sock = sock
        self._lock = threading.Condition()
        self._ready: dict | None = None
        self._replies: dict[int, dict] = {}
        self._titles: dict[int, list[str]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._next_id = 0
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="gyre-zygote", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, preload: Sequence[str] = WORKER_MODULES, env: Mapping[str, str] | None = None) -> Zygote:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gyre_cell.zygote", str(theirs.fileno()), *preload],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                pass_fds=[theirs.fileno()],
                start_new_session=True,
                preexec_fn=partial(_die_with_parent, os.getpid()),
            )
        finally:
            theirs.close()
        return cls(proc, ours)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The zygote's exit status once it ended (0: it left by itself on `close`; -9: `close` had to kill it)."""
        return self._proc.poll()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        with self._lock:
            if not self._lock.wait_for(lambda: self._ready is not None or self._gone, timeout_s):
                raise ZygoteError(f"not ready after {timeout_s:.0f} s")
            if self._ready is None:
                raise ZygoteError(f"exited during start-up ({self._proc.poll()})")
            if not self._ready.get("ready"):
                raise ZygoteError(str(self._ready.get("error")))

    def spawn(
        self,
        entry: str,
        args: list[str],
        *,
        title: str,
        env: Mapping[str, str],
        cwd: str,
        stdout: str,
        stderr: str,
        secrets: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> ForkedProcess:
        """Fork a child running `entry(args)` (see the module docstring); raises ZygoteError if it cannot."""
        self.wait_ready()
        with self._lock:
            rid, self._next_id = self._next_id, self._next_id + 1
            req = {
                "id": rid,
                "entry": entry,
                "args": args,
                "title": title,
                "env": dict(env),
                "cwd": cwd,
                "stdout": stdout,
                "stderr": stderr,
                "secrets": list((secrets or {}).items()),
            }
            data = json.dumps(req).encode()
            if len(data) > MAX_MESSAGE:
                raise ZygoteError(f"request of {len(data)} bytes (its environment) exceeds {MAX_MESSAGE}")
            self._titles[rid] = title.split(" ")
            try:
                self._sock.send(data)
            except OSError as exc:
                self._titles.pop(rid)
                raise ZygoteError(f"zygote unreachable: {exc}") from None
            if not self._lock.wait_for(lambda: rid in self._replies or self._gone, timeout_s):
                raise ZygoteError(f"no answer to a fork after {timeout_s:.0f} s")
            reply = self._replies.pop(rid, None)
            if reply is None:
                raise ZygoteError("the zygote exited")
            if "error" in reply:
                raise ZygoteError(reply["error"])
            return reply["child"]

    def close(self) -> None:
        """End the zygote (its children die with it: stop them first). One still importing is killed at once: it
        would read the socket's end only once its imports are done."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            if self._ready is None:
                raise subprocess.TimeoutExpired(self._proc.args, 0)
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)
        self._sock.close()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            with self._lock:
                if "ready" in msg:
                    self._ready = msg
                elif "exited" in msg:  # always after its pid reply: the zygote reaps only between requests
                    if (child := self._children.pop(msg["exited"], None)) is not None:
                        child._end(msg["returncode"])
                else:
                    if "pid" in msg:
                        child = ForkedProcess(msg["pid"], self._titles.pop(msg["id"]))
                        msg["child"] = self._children[msg["pid"]] = child
                    self._replies[msg["id"]] = msg
                self._lock.notify_all()
        with self._lock:  # the zygote is gone, and its children with it (PDEATHSIG SIGKILL)
            self._gone = True
            for child in self._children.values():
                _wait_gone(child.pid)
                child._end(-signal.SIGKILL)
            self._children.clear()
            self._lock.notify_all()


def _wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    """Until `pid` no longer exists (an orphan is reaped by init once its SIGKILL lands)."""
    for _ in range(int(timeout_s / 0.01)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.dont_write_bytecode = False  # what it preloads keeps its bytecode for the next start (gyre_cell.cli)
    sock = socket.socket(fileno=int(argv[0]))
    return serve(sock, argv[1:])


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's shutdown: what the preloaded modules left behind (a non-daemon thread among
    # them) held it until close() killed it after 5 s, at the end of every run. Nothing here needs flushing: the
    # children hold their own files, and the zygote writes only to its socket.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
