"""The micro-step coordinator serves only holders of the run's key: no usable default key.

The library's old default (``gyre-train``) let any local process act as a cell. A config built without a key now gets
a fresh random one (only processes handed that config know it), a short or empty key is refused, and a run derives
its key from the run's secret (`coordinator_key`).
"""

from __future__ import annotations

from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import orjson
import pytest

from gyre_train.multicell import Coordinator, MultiCellConfig, coordinator_key
from gyre_train.ports import free_port
from gyre_train.types import CellRequest, CoordinatorReply


def _config(**kw) -> MultiCellConfig:
    return MultiCellConfig(num_cells=2, master_port=1, control_port=free_port(), snapshot_dir=".", **kw)


def test_no_config_shares_a_default_key():
    a, b = _config(), _config()
    assert a.authkey != b.authkey and len(a.authkey) >= 32
    assert a.authkey != "gyre-train"
    assert a.authkey not in repr(a)  # never logged with the config
    for weak in ("gyre-train", "", "x" * 31):
        with pytest.raises(ValueError, match="authkey"):
            _config(authkey=weak)


def test_the_run_key_is_derived_from_the_run_secret():
    key = coordinator_key("run-secret-1")
    assert key == coordinator_key("run-secret-1") and key != coordinator_key("run-secret-2")
    assert "run-secret-1" not in key and len(key) == 64
    assert _config(authkey=key).authkey == key
    with pytest.raises(ValueError):
        coordinator_key("")


def _refused(address: tuple[str, int], key: bytes) -> bool:
    """Refused in the handshake, or at the first request."""
    try:
        with Client(address, authkey=key) as conn:
            conn.send_bytes(CellRequest(op="join", cell=1).model_dump_json().encode())
            conn.recv_bytes()
    except (AuthenticationError, EOFError, ConnectionError):
        return True
    return False


@pytest.mark.parametrize("secret", [None, "the run's secret"])
def test_only_the_key_holder_is_served(secret):
    """The old default key and a wrong key are refused on their own connections; the holder of the key is served
    after them. No request reaches the trainer here (a join with no batch open is answered `wait`)."""
    cfg = _config() if secret is None else _config(authkey=coordinator_key(secret))
    coord = Coordinator(cfg, trainer=None)  # type: ignore[arg-type]
    address = (cfg.host, cfg.control_port)
    try:
        for key in (b"gyre-train", b"not-the-key", coordinator_key("another run's secret").encode()):
            assert _refused(address, key), key
        with Client(address, authkey=cfg.authkey.encode()) as conn:
            conn.send_bytes(CellRequest(op="join", cell=1).model_dump_json().encode())
            reply = CoordinatorReply.model_validate(orjson.loads(conn.recv_bytes()))
        assert reply.status == "wait" and reply.error is None
    finally:
        coord.close()
