"""`gyre_train.ports.free_port`: a port below the kernel's ephemeral range (where outgoing connections take theirs),
free when chosen; the OS's own choice when there is no room below the range; `free_ports`: several, distinct."""

from __future__ import annotations

import socket

from gyre_train import ports


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
