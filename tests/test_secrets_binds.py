"""A one-host `gyre run`: every listening socket binds loopback, and the micro-step coordinator needs the run's key.

Read while a satellite trains (the coordinator, the gloo world and its store, the proxy, the cell workers, gyre-eval
and the dashboard all listen then): the TCP sockets in LISTEN state of every process of the run, from /proc (each
process's socket inodes in its /proc/PID/net/tcp and tcp6). None may listen on the wildcard address, except a
socket confined to the loopback interface (SO_BINDTODEVICE: Mooncake's, whose library binds the wildcard with no
option; `ss` shows them as ``0.0.0.0%lo``). The coordinator refuses the library's old default key and a wrong one.
The run then finishes its steps: the keyed coordinator and the bound store still train.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from gyre_cell.binds import ListeningSocket, listening_sockets

pytestmark = pytest.mark.slow


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _confined_to_loopback(sock: ListeningSocket) -> bool:
    """`ss` reads the socket's bound device (inet_diag): ``ADDR%lo:PORT``."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{sock.port}"], capture_output=True, text=True).stdout
    return any(f"%lo:{sock.port}" in line.split()[3] for line in out.splitlines() if len(line.split()) > 3)


def _refused(address: tuple[str, int], key: bytes) -> bool:
    try:
        with Client(address, authkey=key) as conn:
            conn.send_bytes(b'{"op": "join", "cell": 1}')
            conn.recv_bytes()
    except (AuthenticationError, EOFError, ConnectionError):
        return True
    return False


@pytest.mark.skipif(
    shutil.which("ss") is None, reason="needs `ss` (iproute2) to read a socket's bound device"
)
def test_a_run_listens_on_loopback_only_and_its_coordinator_needs_the_key(tmp_path, fault_run):
    run_dir = tmp_path / "run"
    seen: dict[str, object] = {}

    def satellite_claimed(lines: list[dict]) -> bool:
        return any(x["ev"] == "microstep_claim" and x["cell"] > 0 for x in lines)

    def inspect() -> None:
        import os

        pids = _descendants(os.getpid())
        sockets = {pid: listening_sockets(pid) for pid in pids if Path(f"/proc/{pid}").exists()}
        seen["listeners"] = sum(len(s) for s in sockets.values())
        seen["open"] = [
            (pid, s.address, s.port)
            for pid, socks in sockets.items()
            for s in socks
            if s.wildcard and not _confined_to_loopback(s)
        ]
        seen["not_loopback"] = [
            (pid, s.address, s.port)
            for pid, socks in sockets.items()
            for s in socks
            if not s.wildcard and not s.address.startswith("127.") and s.address != "::1"
        ]
        core = json.loads((run_dir / "cells" / "cell-0.json").read_text())
        address = (core["training"]["master_host"] or core["host"], core["training"]["coordinator_port"])
        seen["store_port"] = core["training"]["master_port"]
        seen["ports"] = {s.port for socks in sockets.values() for s in socks}
        seen["refused"] = [_refused(address, key) for key in (b"gyre-train", b"not-the-run-key" * 3)]

    summary = fault_run(
        tmp_path, run_dir, satellite_claimed, inspect, "train.steps=2", "dashboard.enabled=true"
    )
    assert seen["listeners"] >= 5, seen  # proxy, gyre-eval, workers, coordinator, store, dashboard...
    assert seen["store_port"] in seen["ports"]  # the gloo store was read (bound to loopback)
    assert seen["open"] == [], f"listening on every interface: {seen['open']}"
    assert seen["not_loopback"] == [], seen["not_loopback"]
    assert seen["refused"] == [True, True]
    assert summary is not None and summary["steps"] >= 2, summary
