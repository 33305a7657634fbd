"""Opening a Mooncake transfer engine, with errors that name the fix.

The `mooncake` module comes from one of two wheels (`mooncake-transfer-engine-non-cuda` on CPU machines,
`mooncake-transfer-engine` on CUDA ones); its native library links against `libibverbs.so.1` (Debian package
`libibverbs1`) even when only TCP is used, so a missing system library shows up as an ImportError/OSError.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gyre_cell.binds import confine_listeners, interface_of, listening_sockets
from gyre_cell.errors import MooncakeUnavailableError, TransferError, TransferTimeoutError

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install the system library with `apt-get install libibverbs1` and the Python wheel: "
    "`pip install 'gyre-cell[mooncake]'` (CPU machines) or `pip install 'gyre-cell[mooncake-cuda]'` (the CUDA "
    "wheel, which also needs libcudart.so.12); never both"
)


class MooncakeConfig(BaseModel):
    """How a process opens its Mooncake transfer engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    local_hostname: str = "127.0.0.1"
    """Address peers use to reach this process (its RPC port is chosen by Mooncake)."""
    metadata_server: str = "P2PHANDSHAKE"
    """`P2PHANDSHAKE` exchanges segment metadata directly between peers (no etcd)."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transport: TCP locally and in CI, RDMA in production."""
    device_name: str = ""
    """RDMA device filter (empty: auto-discover)."""


def import_transfer_engine() -> type:
    """`mooncake.engine.TransferEngine`, or MooncakeUnavailableError naming what to install."""
    try:
        module = importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as e:
        raise MooncakeUnavailableError(
            f"cannot import the Mooncake transfer engine ({e}); {INSTALL_HINT}"
        ) from e
    return module.TransferEngine


def open_transfer_engine(config: MooncakeConfig | None = None) -> Any:
    """An initialized TransferEngine; raises MooncakeUnavailableError if it cannot start."""
    cfg = config or MooncakeConfig()
    engine = import_transfer_engine()()
    before = {sock.inode for sock in listening_sockets()}
    rc = engine.initialize(cfg.local_hostname, cfg.metadata_server, cfg.protocol, cfg.device_name)
    if rc != 0:
        raise MooncakeUnavailableError(
            f"Mooncake TransferEngine.initialize({cfg.local_hostname!r}, {cfg.metadata_server!r}, "
            f"{cfg.protocol!r}) returned {rc}; check the address is local and, for RDMA, that the HCAs are up; "
            f"if the library is broken, {INSTALL_HINT}"
        )
    _confine(cfg.local_hostname, before)
    return engine


def _confine(local_hostname: str, before: set[int]) -> None:
    """Mooncake listens on every interface, with no option to choose (`gyre_cell.binds`): restrict its new
    listeners to the interface of the address its peers use. Its handshake answers anyone who reaches it, so this is
    what keeps other machines (on one host: everything but loopback) away."""
    try:
        interface = interface_of(local_hostname)
    except ValueError:  # a host name: the interface is unknown
        interface = None
    if interface is None:
        log.warning("Mooncake listens on every interface: %r is no address of this machine", local_hostname)
        return
    confine_listeners(interface, before)


def peer_address(config: MooncakeConfig, engine: Any) -> str:
    """The segment name peers use in P2P handshake mode: `host:rpc_port`."""
    return f"{config.local_hostname}:{engine.get_rpc_port()}"


POLL_S = (0.0002, 0.002)
"""First and longest pause between two status checks of `read_pieces`."""


def read_pieces(
    engine: Any,
    peer: str,
    local: Sequence[int],
    remote: Sequence[int],
    lengths: Sequence[int],
    *,
    timeout_s: float,
) -> None:
    """Read `lengths[i]` bytes at `remote[i]` on `peer` into `local[i]`, all pieces at once; raises TransferError.

    Not `batch_transfer_sync_read`: it waits by asking for the status in a loop with no pause, and on a machine with
    few cores that thread takes a core from the transfer threads it waits for (210 MB over loopback on 2 cores:
    0.117 s that way, 0.044-0.074 s with pauses, raw TCP 0.06 s). Each piece is its own batch: the status call
    reports one batch, and a batch of several pieces was once reported done with bytes still missing.
    Every piece has ended (done or failed) when this returns or raises, so no late write lands in `local` after; a
    piece still running after `timeout_s` raises TransferTimeoutError: the buffer is unusable (the caller closes it).
    """
    batches, refused = [], 0
    for dst, src, n in zip(local, remote, lengths, strict=True):
        batch = engine.batch_transfer_async_read(peer, [dst], [src], [n])
        if batch:
            batches.append(batch)
        else:
            refused += 1
    deadline = time.monotonic() + timeout_s
    failed, pause = 0, POLL_S[0]
    while batches:
        running = []
        for batch in batches:
            status = engine.transfer_check_status(batch)  # 1 done, 0 running, -1 failed, -2 timed out
            if status == 0:
                running.append(batch)
            elif status != 1:
                failed += 1
        batches = running
        if batches and time.monotonic() > deadline:
            raise TransferTimeoutError(
                f"reading {sum(lengths)} bytes from {peer}: {len(batches)} pieces still running after "
                f"{timeout_s} s; the local buffer is unusable"
            )
        if batches:
            time.sleep(pause)
            pause = min(pause * 2, POLL_S[1])
    if refused or failed:
        raise TransferError(
            f"reading {sum(lengths)} bytes from {peer}: {refused} pieces refused, {failed} failed"
        )
