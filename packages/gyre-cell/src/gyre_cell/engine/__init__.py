"""The torch rollout engine: paged KV cache, continuous batching, SGLang's HTTP protocol subset.

The names below load on first use (PEP 562): `TorchEngine` imports torch, and the controller, which only needs
`gyre_cell.engine.config` (a cell's config embeds `EngineConfig`), must start without it (torch is ~2.5 s of
CPU at every `gyre run`'s start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from gyre_cell.errors import EngineInputError, EngineStateError

    from .config import EngineConfig
    from .core import TorchEngine
    from .request import SamplingSpec

__all__ = ["EngineConfig", "EngineInputError", "EngineStateError", "SamplingSpec", "TorchEngine"]

_SOURCES = {
    "EngineConfig": ".config",
    "TorchEngine": ".core",
    "EngineInputError": ".request",
    "EngineStateError": ".request",
    "SamplingSpec": ".request",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)
