"""`gyre_train.ports.free_port`: a port below the kernel's ephemeral range (where outgoing connections take theirs),
free when chosen and not reserved by another draw on this host; the OS's own choice when there is no room below the
range; `free_ports`: several, distinct."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from gyre_train import ports


@pytest.fixture(autouse=True)
def reservations(tmp_path, monkeypatch):
    """This test's own reservations: the host's are other processes' (the suite's runs beside it)."""
    folder = tmp_path / "reserved"
    monkeypatch.setattr(ports, "_reservations", lambda: folder)
    return folder


def test_ports_are_free_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    chosen = [ports.free_port() for _ in range(50)]
    assert all(20000 <= p < low for p in chosen), chosen
    for p in chosen[:5]:  # each can be bound right away
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_held_by_a_listener_is_never_chosen(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(ports, "_LOW", port)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: port + 2)  # candidates: port (held) and port + 1
        assert port not in {ports.free_port(attempts=40) for _ in range(10)}


def test_no_room_below_the_range_falls_back_to_the_os(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1024)
    assert ports.free_port() >= 1024


def test_ports_chosen_together_are_distinct_even_when_few_are_free(monkeypatch):
    # 4 candidates below the range, 4 ports asked: each draw alone could return any of them, together they differ
    low = 31000
    monkeypatch.setattr(ports, "_LOW", low)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: low + 4)
    for _ in range(20):  # four independent draws are all distinct 9% of the time
        chosen = ports.free_ports(4)
        assert len(set(chosen)) == 4, chosen
    assert ports.free_port(attempts=200, exclude=[low, low + 1, low + 2]) not in (low, low + 1, low + 2)
    five = ports.free_ports(5)  # one more than the room below: the OS's choice for the rest, still distinct
    assert len(set(five)) == 5


def _two_free_ports() -> int:
    """`low` where `low` and `low + 1` are both free, below the ephemeral range (outgoing connections take theirs)."""
    for low in range(24000, 32000, 7):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", low))
                b.bind(("127.0.0.1", low + 1))
            except OSError:
                continue
            return low
    raise AssertionError("no two adjacent free ports")


def test_a_port_another_process_drew_is_not_drawn_again_until_its_reservation_ends(monkeypatch, reservations):
    """CI saw gyre-eval exit with "address already in use": two runs beside each other could draw the same port,
    each checking only that nothing had bound it yet."""
    low = _two_free_ports()
    candidates = {low, low + 1}
    monkeypatch.setattr(ports, "_LOW", low)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: low + 2)
    child = (
        "from pathlib import Path; from gyre_train import ports; "
        f"ports._reservations = lambda: Path({str(reservations)!r}); ports._LOW = {low}; "
        f"ports._ephemeral_low = lambda: {low + 2}; print(ports.free_port(attempts=200))"
    )
    theirs = int(
        subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    )
    assert theirs in candidates
    ours = ports.free_port(attempts=200)
    assert ours == (candidates - {theirs}).pop()  # never theirs, though free: reserved by the other process
    assert ports.free_port(attempts=200) not in candidates  # both reserved: the OS's choice
    stale = time.time() - ports.RESERVED_S - 1
    os.utime(reservations / str(theirs), (stale, stale))  # the other process's reservation has ended
    assert ports.free_port(attempts=200) == theirs
