"""Choosing a port for a server that binds it a moment later.

Asking the OS for port 0 returns one from the kernel's ephemeral range, the range every outgoing TCP connection
also takes its local port from; on a busy machine one of them can take the port between the choice and the bind
(seen: a cell worker's HTTP server failing with "address already in use" while tests ran beside it). So the port is
drawn at random below that range and above Ray's default worker ports (10002-19999), and checked free by binding it.

Several ports chosen before any is bound must be chosen together (`free_ports`): each draw checks only that nothing
holds the port now, so two independent draws can return the same one (seen: a CI run whose cell 2 HTTP server and the
core's micro-step coordinator drew the same port, and the core's set-up failed with "address already in use").
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

__all__ = ["free_port", "free_ports"]

_LOW = 20000
"""Above Ray's default worker port range."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", attempts: int = 200, exclude: Collection[int] = ()) -> int:
    """A port nothing holds on `host` now, outside the ephemeral range when there is room below it; never one of
    `exclude` (ports chosen already and not bound yet)."""
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
