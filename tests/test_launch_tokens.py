"""The launcher's side of the trust model, on real processes: a child reads its token from an inherited pipe (never
argv, environment or disk), dies with the controller, and its death ends the run with one line naming it."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gyre.launch.base import ServiceError
from gyre.launch.local import LocalLauncher
from gyre.launch.tokens import RunTokens

ROOT = Path(__file__).resolve().parents[1]

# Reads the token from the fd named by --token-fd, logs its digest, then waits for a signal.
PROBE = (
    "import hashlib, os, signal, sys; fd = int(sys.argv[sys.argv.index('--token-fd') + 1]); "
    "t = os.read(fd, 4096).strip(); os.close(fd); "
    "print('digest', hashlib.sha256(t).hexdigest(), flush=True); signal.pause()"
)


def _wait(what: str, found, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (value := found()):
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.02)
    return value


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_tokens_are_fresh_and_hidden():
    a, b = RunTokens(), RunTokens()
    assert len(set(a.values()) | set(b.values())) == 6 and all(len(t) >= 40 for t in a.values())
    assert all(t not in repr(a) for t in a.values())


def test_child_reads_its_token_from_a_pipe_and_its_death_is_one_line(tmp_path):
    launcher = LocalLauncher(tmp_path)
    token = launcher.tokens.eval
    proc = launcher._spawn("probe", [sys.executable, "-c", PROBE], {"--token-fd": token})
    log = tmp_path / "logs" / "probe.log"
    try:
        line = _wait("digest", lambda: log.exists() and log.read_text().strip())
        assert line == f"digest {hashlib.sha256(token.encode()).hexdigest()}"
        for name in ("cmdline", "environ"):
            assert token.encode() not in Path(f"/proc/{proc.pid}/{name}").read_bytes()
        assert not any(token.encode() in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
        fds = [
            os.readlink(f"/proc/{proc.pid}/fd/{fd}")
            for fd in os.listdir(f"/proc/{proc.pid}/fd")
            if int(fd) > 2
        ]
        assert not [f for f in fds if f.startswith("pipe:")], fds  # the child closed the pipe once read

        async def call_the_dead_service() -> None:  # a client that notices first: refused connection
            os.kill(proc.pid, signal.SIGKILL)
            _wait("the probe's exit", lambda: proc.poll() is not None)
            raise httpx.ConnectError("All connection attempts failed")

        with pytest.raises(ServiceError) as failed:
            asyncio.run(launcher.supervise(call_the_dead_service()))
        assert str(failed.value) == f"probe exited (killed by SIGKILL); see {log}"
    finally:
        launcher.stop(grace_s=1.0)


def test_supervise_stops_the_work_when_a_service_dies_and_leaves_cells_to_the_controller(tmp_path):
    launcher = LocalLauncher(tmp_path)
    cell = launcher._spawn("cell-0", [sys.executable, "-c", "import signal; signal.pause()"])
    service = launcher._spawn("proxy", [sys.executable, "-c", "import signal; signal.pause()"])
    stopped = []

    async def main() -> None:
        async def forever() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                stopped.append(True)

        os.kill(cell.pid, signal.SIGKILL)  # a cell's death is the controller's to report (and recover)
        _wait("the cell's exit", lambda: cell.poll() is not None)
        assert launcher.dead_service() is None
        work = asyncio.ensure_future(launcher.supervise(forever()))
        os.kill(service.pid, signal.SIGKILL)
        with pytest.raises(
            ServiceError, match=r"^proxy exited \(killed by SIGKILL\); see .*/logs/proxy\.log$"
        ):
            await asyncio.wait_for(work, timeout=10)

    try:
        asyncio.run(main())
        assert stopped == [True]
    finally:
        launcher.stop(grace_s=1.0)


def test_children_die_with_the_controller(tmp_path):
    code = (
        "import signal, sys; from pathlib import Path; from gyre.launch.local import LocalLauncher; "
        f"l = LocalLauncher(Path({str(tmp_path)!r})); "
        "p = l._spawn('proxy', [sys.executable, '-c', 'import signal; signal.pause()']); "
        "print(p.pid, flush=True); signal.pause()"
    )
    controller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        child = int(controller.stdout.readline())
        assert _alive(child)
        controller.kill()
        controller.wait(timeout=10)
        _wait("the child's exit after the controller's", lambda: not _alive(child), timeout_s=15.0)
    finally:
        controller.kill()
        controller.wait()


def test_supervise_restarts_a_restartable_service_then_gives_up(tmp_path):
    """gyre-eval's case: restarted on its port (its state is on disk); after MAX_RESTARTS the next death is one line."""
    from gyre.launch.base import MAX_RESTARTS, free_port

    launcher = LocalLauncher(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    argv = [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(tmp_path),
    ]
    launcher._restartable["web"] = (argv, {}, url)

    def pid() -> int:
        return dict(launcher._procs)["web"].pid

    async def answers(http: httpx.AsyncClient) -> bool:
        try:
            return (await http.get(url)).status_code == 200
        except httpx.TransportError:
            return False

    async def main() -> None:
        await launcher._wait_healthy("web", launcher._spawn("web", argv), url, 120.0)

        async def kill_and_wait_for_restart(times: int) -> int:
            async with httpx.AsyncClient(timeout=5.0) as http:
                for n in range(1, times + 1):
                    before = pid()
                    os.kill(before, signal.SIGKILL)
                    deadline = time.monotonic() + 120
                    while launcher.restarts.get("web") != n:  # gate: counted once the new process answered
                        assert time.monotonic() < deadline, f"restart {n} not done"
                        await asyncio.sleep(0.02)
                    assert pid() != before and await answers(http)  # a new process, on the same port
            return n

        assert await launcher.supervise(kill_and_wait_for_restart(MAX_RESTARTS)) == MAX_RESTARTS
        os.kill(pid(), signal.SIGKILL)
        with pytest.raises(ServiceError, match=r"^web exited \(killed by SIGKILL\); see .*/logs/web\.log$"):
            await asyncio.wait_for(launcher.supervise(asyncio.Event().wait()), timeout=60)
        assert launcher.service_died

    try:
        asyncio.run(main())
    finally:
        launcher.stop()


def test_a_services_port_is_held_by_the_launcher_from_its_choice_through_a_restart(tmp_path):
    """CI saw gyre-eval exit at start with "address already in use": the launcher only chose its port, and another
    process bound it before the service did. Now the launcher binds the socket and the service inherits it: a
    process trying that port before the service starts, or while it is dead, is refused; a request made while it is
    dead waits in the held socket's queue and is answered by the restarted service."""
    from gyre_eval.config import ServiceConfig

    launcher = LocalLauncher(tmp_path)
    refused: list[int] = []

    def try_to_take(port: int) -> None:
        with socket.socket() as thief:
            try:
                thief.bind(("127.0.0.1", port))
            except OSError as e:
                refused.append(e.errno)
                return
            pytest.fail(f"another process could bind port {port}")  # the service would then exit 3

    start_process = launcher._start_process

    def start_after_a_try(name, argv, tokens, env):
        try_to_take(int(argv[argv.index("--port") + 1]))  # between the choice and the service's own start
        return start_process(name, argv, tokens, env)

    launcher._start_process = start_after_a_try

    async def main() -> None:
        await launcher.start_eval(ServiceConfig())
        url = f"{launcher.eval_url}/healthz"
        proc = dict(launcher._procs)["gyre-eval"]
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
        try_to_take(int(launcher.eval_url.rsplit(":", 1)[1]))  # dead, its port still held
        async with httpx.AsyncClient(timeout=120.0) as http:
            answer = await launcher.supervise(http.get(url))  # sent while it is dead
        assert answer.status_code == 200 and launcher.restarts == {"gyre-eval": 1}
        assert dict(launcher._procs)["gyre-eval"].pid != proc.pid

    try:
        asyncio.run(main())
    finally:
        launcher.stop()
    assert refused == [errno.EADDRINUSE] * 3  # before the start, while dead, before the restart
