"""Choosing a port for a server that binds it a moment later.

Asking the OS for port 0 returns one from the kernel's ephemeral range, the range every outgoing TCP connection
also takes its local port from; on a busy machine one of them can take the port between the choice and the bind
(seen: a cell worker's HTTP server failing with "address already in use" while tests ran beside it). So the port is
drawn at random below that range and above Ray's default worker ports (10002-19999), and checked free by binding it.

Several ports chosen before any is bound must be chosen together (`free_ports`): each draw checks only that nothing
holds the port now, so two independent draws can return the same one (seen: a CI run whose cell 2 HTTP server and the
core's micro-step coordinator drew the same port, and the core's set-up failed with "address already in use").

Processes of one host draw apart too: a chosen port is reserved for `RESERVED_S` by a file created exclusively in a
per-user directory, and no other draw on this host takes it meanwhile (seen: a CI run whose gyre-eval exited at
start with "address already in use" while other runs drew ports beside it). The bind check still guards against
processes that do not draw here; a directory that cannot be written leaves only that check.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

__all__ = ["free_port", "free_ports"]

_LOW = 20000
"""Above Ray's default worker port range."""

RESERVED_S = 600.0
"""How long a drawn port stays reserved for whoever drew it: longer than a server takes to bind what it was given
(a cell worker's start, behind its zygote's imports, on a loaded machine)."""


def _reservations() -> Path:
    return Path(tempfile.gettempdir()) / f"gyre-ports-{os.getuid()}"


def _reserve(port: int) -> bool:
    """Claim `port` among this host's draws; False if another draw holds it (a stale claim is removed, for later)."""
    folder = _reservations()
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(folder / str(port), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return True
    except FileExistsError:
        try:
            if time.time() - (folder / str(port)).stat().st_mtime > RESERVED_S:
                (folder / str(port)).unlink()
        except OSError:
            pass
        return False
    except OSError:  # no writable temporary directory: the bind check alone
        return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", attempts: int = 200, exclude: Collection[int] = ()) -> int:
    """A port nothing holds on `host` now and no other draw on this host reserved, outside the ephemeral range when
    there is room below it; never one of `exclude` (ports chosen already and not bound yet)."""
    high = _ephemeral_low() - 1
    rng = random.Random()  # not the process's seeded generator: runs with the same seed must not collide
    for _ in range(attempts if high > _LOW else 0):
        port = rng.randint(_LOW, high)
        if port in exclude:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if _reserve(port):
            return port
    while True:  # no room below the ephemeral range (or all taken): the OS's choice
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port


def free_ports(n: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """`n` distinct ports, each free on `host` now (`free_port`) and none of `exclude`, for servers that bind them
    later."""
    chosen: list[int] = []
    for _ in range(n):
        chosen.append(free_port(host, exclude=[*exclude, *chosen]))
    return chosen
