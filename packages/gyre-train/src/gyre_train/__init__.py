"""gyre_train: streaming GSPO with execution-level normalization; micro-steps claimed by cells from one queue; torch
and Megatron-core backends; checkpoints and a single-process replay of any dumped batch.

The names below load on first use (PEP 562): `gyre_train.loss_config`, `gyre_train.ports` and the wire types stay
importable without loading torch (a run's config embeds `LossConfig`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gyre_train.buffer import TrajectoryBuffer
    from gyre_train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from gyre_train.loss_config import LossConfig
    from gyre_train.multicell import CoreRunner, MultiCellConfig
    from gyre_train.packing import PackingConfig, StreamPackingBuffer
    from gyre_train.replay import replay_batch
    from gyre_train.trainer import Trainer, TrainerConfig
    from gyre_train.types import MicroStep, ReadyGroupMessage, StepReport

__all__ = [
    "CoreRunner",
    "LossConfig",
    "MicroStep",
    "MultiCellConfig",
    "PackingConfig",
    "ReadyGroupMessage",
    "StepReport",
    "StreamPackingBuffer",
    "Trainer",
    "TrainerConfig",
    "TrajectoryBuffer",
    "latest_checkpoint",
    "load_checkpoint",
    "replay_batch",
    "save_checkpoint",
]

_SOURCES = {
    "CoreRunner": "gyre_train.multicell",
    "LossConfig": "gyre_train.loss_config",
    "MicroStep": "gyre_train.types",
    "MultiCellConfig": "gyre_train.multicell",
    "PackingConfig": "gyre_train.packing",
    "ReadyGroupMessage": "gyre_train.types",
    "StepReport": "gyre_train.types",
    "StreamPackingBuffer": "gyre_train.packing",
    "Trainer": "gyre_train.trainer",
    "TrainerConfig": "gyre_train.trainer",
    "TrajectoryBuffer": "gyre_train.buffer",
    "latest_checkpoint": "gyre_train.checkpoint",
    "load_checkpoint": "gyre_train.checkpoint",
    "replay_batch": "gyre_train.replay",
    "save_checkpoint": "gyre_train.checkpoint",
}


def __getattr__(name: str) -> Any:
    if (source := _SOURCES.get(name)) is None:
        raise AttributeError(f"module 'gyre_train' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(source), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
