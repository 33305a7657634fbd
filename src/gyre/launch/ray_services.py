"""The run's services (the TITO proxy, gyre-eval) placed on a Ray node by the config (`[launcher] proxy_resources`,
`eval_resources`).

A `ServiceActor` runs on a node that offers the configured resources. It binds a socket there and holds it
(`bound_socket`), and reports the node's address, the port and the socket's fd; the controller builds the service's
command line with them (`--host NODE_IP --port P --listen-fd FD`) and hands it to the actor, which starts the service as its own child with the same CLI the local launcher runs. The run's tokens
travel as call arguments over Ray's channel and reach the child through inherited pipes (`gyre.launch.tokens`):
never argv, env or a file. The child's output goes to RUN/logs/NAME.log (the run directory is on a filesystem every
node sees) and it dies with the actor.

The controller holds a `RemoteProcess` per service: the part of `subprocess.Popen` the launcher uses (`poll`,
`wait`, `pid`, `returncode`) plus `signal_group`, so watching, restarting a dead gyre-eval (same actor, node, port
and token) and stopping work as for a local child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gyre.launch.base import bound_socket, spawn_child

__all__ = ["RemoteProcess", "ServiceActor"]


class ServiceActor:
    """One service's home on its node: its address, then its process (started again on the same port if asked)."""

    def __init__(self, name: str, log_path: str) -> None:
        self.name, self.log_path = name, log_path
        self._proc: subprocess.Popen | None = None
        self._returncode: int | None = None
        self._sock = None

    def node(self, listen: bool = False) -> dict:
        """Where this actor runs; with `listen`, also a socket bound there for the service (its port and fd)."""
        import ray

        ip = ray.util.get_node_ip_address()
        where = {
            "ip": ip,
            "actor_pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "python": sys.executable,
        }
        if listen:
            if self._sock is None:  # held as long as the actor lives: every start of the service inherits it
                self._sock = bound_socket(ip)
            where |= {"port": self._sock.getsockname()[1], "listen_fd": self._sock.fileno()}
        return where

    def spawn(
        self,
        argv: list[str],
        tokens: dict[str, str],
        env: dict[str, str],
        cwd: str | None = None,
        stdout_path: str | None = None,
    ) -> int:
        """Start the service; returns its PID. The child is started, then waited for, by one thread that lives as
        long as it: the child's parent-death signal fires when the thread that forked it ends."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                out = Path(stdout_path) if stdout_path else None
                inherit = (self._sock.fileno(),) if self._sock is not None else ()
                self._proc = spawn_child(argv, tokens, env, Path(self.log_path), cwd, out, inherit)
                self._returncode = None
            except BaseException as exc:  # reported to the caller below
                failure.append(exc)
                return
            finally:
                started.set()
            self._returncode = self._proc.wait()

        threading.Thread(target=run, name=f"{self.name}-child", daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]
        assert self._proc is not None
        return self._proc.pid

    def poll(self) -> int | None:
        return self._returncode

    def signal_group(self, sig: int) -> None:
        if self._proc is not None and self._returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)


class RemoteProcess:
    """A service process inside a `ServiceActor`, seen from the controller like a `subprocess.Popen`.

    A dead actor (its node lost) reads as a process killed by SIGKILL."""

    def __init__(self, actor: Any, pid: int, poll_timeout_s: float = 10.0) -> None:
        self.actor, self.pid, self.returncode = actor, pid, None
        self._poll_timeout_s = poll_timeout_s

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        import ray

        try:
            self.returncode = ray.get(self.actor.poll.remote(), timeout=self._poll_timeout_s)
        except ray.exceptions.GetTimeoutError:
            return None  # a busy actor is not a dead one
        except ray.exceptions.RayError:
            self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"{self.actor}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def signal_group(self, sig: int) -> None:
        import ray

        try:
            ray.get(self.actor.signal_group.remote(sig), timeout=self._poll_timeout_s)
        except ray.exceptions.RayError:
            if sig == signal.SIGKILL:  # the actor is stuck or gone: take it down with its child
                with contextlib.suppress(Exception):
                    ray.kill(self.actor)
