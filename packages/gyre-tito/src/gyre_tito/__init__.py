"""gyre_tito: a token-in-token-out proxy for black-box agent harnesses (Anthropic Messages, OpenAI Chat) that records
every call's exact token ids and behaviour log-probs per execution, builds each execution's trajectory tree with its
provenance masks, and selects the trajectories to train on (J_max). It installs alone into other RL stacks
(`gyre_tito.integrations`: TRL, SkyRL, verl).

The names below load on first use (PEP 562): importing `gyre_tito` costs nothing, and a stack that needs only the
record types does not load the proxy's web server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gyre_tito.export import read_trajectories, write_trajectories
    from gyre_tito.materialize import select_trajectories
    from gyre_tito.proxy import Proxy
    from gyre_tito.proxy_config import ProxyConfig
    from gyre_tito.records import ExecutionRecords, RecordStore
    from gyre_tito.selection import SelectionConfig
    from gyre_tito.server import create_app
    from gyre_tito.testing import ProxyServer
    from gyre_tito.types import CallRecord, Trajectory

__all__ = [
    "CallRecord",
    "ExecutionRecords",
    "Proxy",
    "ProxyConfig",
    "ProxyServer",
    "RecordStore",
    "SelectionConfig",
    "Trajectory",
    "create_app",
    "read_trajectories",
    "select_trajectories",
    "write_trajectories",
]

_SOURCES = {
    "CallRecord": "gyre_tito.types",
    "ExecutionRecords": "gyre_tito.records",
    "Proxy": "gyre_tito.proxy",
    "ProxyConfig": "gyre_tito.proxy_config",
    "ProxyServer": "gyre_tito.testing",
    "RecordStore": "gyre_tito.records",
    "SelectionConfig": "gyre_tito.selection",
    "Trajectory": "gyre_tito.types",
    "create_app": "gyre_tito.server",
    "read_trajectories": "gyre_tito.export",
    "select_trajectories": "gyre_tito.materialize",
    "write_trajectories": "gyre_tito.export",
}


def __getattr__(name: str) -> Any:
    if (source := _SOURCES.get(name)) is None:
        raise AttributeError(f"module 'gyre_tito' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(source), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
