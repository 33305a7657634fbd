"""Opening a Mooncake transfer engine, with errors that name the fix.

The `mooncake` module comes from one of two wheels (`mooncake-transfer-engine-non-cuda` on CPU machines,
`mooncake-transfer-engine` on CUDA ones); its native library links against `libibverbs.so.1` (Debian package
`libibverbs1`) even when only TCP is used, so a missing system library shows up as an ImportError/OSError.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gyre_cell.binds import confine_listeners, interface_of, listening_sockets
from gyre_cell.errors import MooncakeUnavailableError

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
