"""gyre_cell: rollout engines (a torch engine speaking SGLang's protocol, an SGLang adapter) behind one
`RolloutEngine` client interface, plus the tiny offline model used by tests and demos.

The names below load on first use (PEP 562): the client imports torch, and importing any light submodule
(`gyre_cell.transfer.mooncake`, `gyre_cell.stop_gate`, `gyre_cell.ports`) runs this file first; a run config
that embeds their types must load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import EngineError, RolloutEngine, TorchEngineClient
    from .types import FinishReason, GenerationResult, WeightVersionSpan

__all__ = [
    "EngineError",
    "FinishReason",
    "GenerationResult",
    "RolloutEngine",
    "TorchEngineClient",
    "WeightVersionSpan",
]

_SOURCES = {
    "EngineError": ".client",
    "RolloutEngine": ".client",
    "TorchEngineClient": ".client",
    "FinishReason": ".types",
    "GenerationResult": ".types",
    "WeightVersionSpan": ".types",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
