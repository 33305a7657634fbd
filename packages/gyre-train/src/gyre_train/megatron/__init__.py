"""Megatron-core backend of gyre-train (extra ``gyre-train[megatron]``).

- :mod:`~gyre_train.megatron.compat`: the CPU compatibility layer (the only place CUDA assumptions are patched).
- :mod:`~gyre_train.megatron.weights`: HF Qwen3 <-> GPTModel names, fused layouts, TP sharding (no megatron import).
- :mod:`~gyre_train.megatron.model`: process groups, GPTModel built from a HF Qwen3 config, weight load/export.
- :mod:`~gyre_train.megatron.backend`: :class:`MegatronBackend`, the ``TrainBackend`` implementation; its settings
  in :mod:`~gyre_train.megatron.config`.
- :mod:`~gyre_train.megatron.pipeline`: the continuous 1F1B of a pipelined cell (``StreamingPipeline``), fed by
  :mod:`~gyre_train.megatron.sources` (``WorkSource``, ``QueueSource``, ``PipelineStats``) and steered over
  :mod:`~gyre_train.megatron.control` (``ControlChannel``).
- :mod:`~gyre_train.megatron.cell`: a pipelined cell among others in a multi-cell run (stage processes driven by the
  cell's leader, the whole cell as one ``TrainBackend``).

Importing this package does not import megatron-core (it takes seconds); the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MegatronBackend", "MegatronBackendConfig", "ParallelConfig"]

_LAZY = {
    "MegatronBackend": "gyre_train.megatron.backend",
    "MegatronBackendConfig": "gyre_train.megatron.config",
    "ParallelConfig": "gyre_train.megatron.model",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
