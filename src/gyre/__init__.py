"""gyre: the meta-package of Gyre. It assembles a run from the five packages (`gyre run`, `gyre demo`): the config
(`load_config`, `RunConfig`) and the CLI (`main`). Its rooms: `gyre.run` (the pipeline and the controller),
`gyre.launch` (launchers), `gyre.observe` (metrics, dashboard, report), `gyre.demo` (the demo's agent, model and
evaluation); the config, tasks and datasets at the top.

The names below load on first use (PEP 562): `gyre --help` and `gyre config` load no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gyre.cli import main
    from gyre.config import ConfigError, RunConfig, load_config

__all__ = ["ConfigError", "RunConfig", "load_config", "main"]

_SOURCES = {
    "ConfigError": "gyre.config",
    "RunConfig": "gyre.config",
    "load_config": "gyre.config",
    "main": "gyre.cli",
}


def __getattr__(name: str) -> Any:
    if (source := _SOURCES.get(name)) is None:
        raise AttributeError(f"module 'gyre' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(source), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
