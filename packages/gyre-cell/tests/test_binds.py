"""gyre_cell.binds: a wildcard listener confined to the loopback interface takes loopback connections only.

Mooncake's listeners are bound to the wildcard in its C++; this is what keeps them off every other interface."""

from __future__ import annotations

import socket

import pytest

from gyre_cell.binds import confine_listeners, interface_of, listening_sockets


def _other_address() -> str | None:
    """A non-loopback IPv4 address of this machine (the one its default route leaves from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # sends nothing
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def _accepts(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=5).close()
    except OSError:
        return False
    return True


def test_a_confined_wildcard_listener_takes_loopback_only():
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no non-loopback address")
    before = {s.inode for s in listening_sockets()}
    with socket.create_server(("0.0.0.0", 0)) as server, socket.create_server(("127.0.0.1", 0)) as bound:
        port = server.getsockname()[1]
        assert _accepts(other, port)  # the wildcard: every address of this machine
        lo = interface_of("127.0.0.1")
        assert lo is not None and interface_of(other) not in (None, lo)
        confined = confine_listeners(lo, before)
        assert [(s.address, s.port) for s in confined] == [("0.0.0.0", port)]  # the bound one is left alone
        assert bound.getsockname()[1] not in {s.port for s in confined}
        assert _accepts("127.0.0.1", port) and not _accepts(other, port)
