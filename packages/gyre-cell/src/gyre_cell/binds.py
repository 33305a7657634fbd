"""Listening sockets of a cell bound to what its peers need: loopback on one machine, the node's address on many.

Two libraries choose their listening addresses themselves:

- gloo's pairs listen on the address of one network interface: GLOO_SOCKET_IFNAME names it, and without it gloo
  takes whatever this machine's host name resolves to (often a LAN address). `confine_gloo(host)` names the interface
  holding the cell's own address.
- Mooncake's transfer engine (0.3.x) binds its handshake listener and its TCP data listener to the wildcard address
  (``INADDR_ANY`` / ``::`` hard-coded in its C++; no option or environment variable changes it: its
  MC_TCP_BIND_ADDRESS only sets the address it advertises). `confine_listeners` binds such sockets, already
  listening, to one interface with SO_BINDTODEVICE: the kernel then refuses connections that did not arrive on it (on
  loopback: every connection not made to a loopback address). `/proc/net/tcp` still shows them as ``0.0.0.0``;
  ``ss -ltn`` shows ``0.0.0.0%lo``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

__all__ = ["ListeningSocket", "confine_gloo", "confine_listeners", "interface_of", "listening_sockets"]

_SIOCGIFFLAGS, _SIOCGIFADDR, _IFF_LOOPBACK = 0x8913, 0x8915, 0x8


@dataclass(frozen=True, slots=True)
class ListeningSocket:
    address: str
    """The bound address (``0.0.0.0`` or ``::`` for the wildcard)."""
    port: int
    inode: int
    fd: int
    """The fd of the process it was read from."""

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified


def _ioctl(name: str, request: int) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            return fcntl.ioctl(s.fileno(), request, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it, or it went away
            return None


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (for a loopback address: the loopback interface)."""
    ip = ipaddress.ip_address(address)
    names = [name for _, name in socket.if_nameindex()]
    if ip.is_loopback:
        for name in names:
            flags = _ioctl(name, _SIOCGIFFLAGS)
            if flags is not None and struct.unpack_from("H", flags, 16)[0] & _IFF_LOOPBACK:
                return name
        return None
    if ip.version == 4:
        for name in names:
            raw = _ioctl(name, _SIOCGIFADDR)
            if raw is not None and socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
        return None
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if ipaddress.ip_address(bytes.fromhex(fields[0])) == ip:
                    return fields[5]
    except OSError:
        pass
    return None


def _socket_inodes(pid: int | str) -> dict[int, int]:
    inodes = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes[int(target[8:-1])] = int(fd)
    return inodes


def _hex_address(raw: str) -> str:
    packed = bytes.fromhex(raw)
    # /proc prints the address as 32-bit words in host byte order
    words = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
    return str(ipaddress.ip_address(words))


def listening_sockets(pid: int | str = "self") -> list[ListeningSocket]:
    """The TCP sockets process ``pid`` holds in LISTEN state (read from /proc: its fds and its network namespace's
    socket tables)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            inode = int(fields[9])
            if fields[3] == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                address, port = fields[1].split(":")
                found.append(ListeningSocket(_hex_address(address), int(port, 16), inode, inodes[inode]))
    return found


def confine_listeners(interface: str, before: set[int]) -> list[ListeningSocket]:
    """Bind this process's wildcard listening sockets that are not in ``before`` (inodes) to ``interface``;
    returns them."""
    confined = []
    for sock in listening_sockets():
        if sock.inode in before or not sock.wildcard:
            continue
        s = socket.socket(fileno=os.dup(sock.fd))
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
        finally:
            s.close()  # the duplicate only: the library keeps its own fd
        confined.append(sock)
    return confined


def confine_gloo(host: str) -> None:
    """Make gloo's pairs listen on the interface holding ``host`` (this cell's address), unless the launcher already
    named one (GLOO_SOCKET_IFNAME)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        interface = interface_of(host)
    except ValueError:  # a host name, not an address: gloo resolves it as before
        return
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
