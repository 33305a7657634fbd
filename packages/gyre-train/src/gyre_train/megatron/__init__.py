"""Megatron-core backend of gyre-train (extra ``gyre-train[megatron]``).

- :mod:`~gyre_train.megatron.compat`: the CPU compatibility layer (the only place CUDA assumptions are patched).
- :mod:`~gyre_train.megatron.weights`: HF Qwen3 <-> GPTModel names, fused layouts, TP sharding (no megatron import).
- :mod:`~gyre_train.megatron.model`: process groups, GPTModel built from a HF Qwen3 config, weight load/export.
- :mod:`~gyre_train.megatron.backend`: :class:`MegatronBackend`, the ``TrainBackend`` implementation.

Importing this package does not import megatron-core (it takes seconds); the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MegatronBackend", "MegatronBackendConfig", "ParallelConfig"]

_LAZY = {
    "MegatronBackend": "gyre_train.megatron.backend",
    "MegatronBackendConfig": "gyre_train.megatron.backend",
    "ParallelConfig": "gyre_train.megatron.model",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
