"""Names a package exports that load on first use (PEP 562): a package whose `__init__` would import torch keeps
its light submodules importable without it (a run config embeds their types; `gyre config` loads no torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], sources: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module `__getattr__` and `__dir__` of `package`: name -> the relative module it comes from (`sources`).
    A loaded name is stored in the package's `namespace`, so later lookups skip the hook."""

    def getattr_(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return getattr_, dir_
