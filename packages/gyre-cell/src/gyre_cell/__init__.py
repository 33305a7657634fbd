"""gyre_cell: rollout engines (a torch engine speaking SGLang's protocol, an SGLang adapter) behind one
`RolloutEngine` client interface, plus the tiny offline model used by tests and demos.

The names below load on first use (PEP 562): the client imports torch, and importing any light submodule
(`gyre_cell.transfer.mooncake`, `gyre_cell.stop_gate`, `gyre_cell.ports`) runs this file first; a run config
that embeds their types must load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

if TYPE_CHECKING:
    from gyre_cell.errors import EngineError

    from .client import RolloutEngine, TorchEngineClient
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


__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)
