"""Checkpoint and resume of the core's trainer state between steps: weights, optimizer, step, buffer positions.

Layout (docs/design/architecture.md#run-directory-and-trace, ``RUN/checkpoints/``)::

    step-<version>/trainer.pt     model + optimizer state (torch.save), policy version
    step-<version>/buffer.json    trajectory buffer content: ready and pending groups, hand-out counter, consumed ids
    step-<version>/meta.json      version and file list (written last: a directory without it is incomplete)

A checkpoint is taken between batches (the stream packing buffer holds nothing then); resuming from it and taking the
next step gives the same update as continuing the original run.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import torch

from gyre_train.trainer import Trainer


def save_checkpoint(root: str | Path, trainer: Trainer) -> Path:
    """Write ``root/step-<version>/`` for the trainer's current version; returns that directory."""
    if trainer.in_batch:
        raise RuntimeError("checkpoint only between steps (a batch is open)")
    out = Path(root) / f"step-{trainer.version}"
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"version": trainer.version, "backend": trainer.core.backend.state_dict()}, out / "trainer.pt")
    (out / "buffer.json").write_bytes(orjson.dumps(trainer.buffer.state_dict()))
    tmp = out / "meta.json.tmp"
    tmp.write_bytes(orjson.dumps({"version": trainer.version, "files": ["trainer.pt", "buffer.json"]}))
    os.replace(tmp, out / "meta.json")
    return out


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest version under ``root`` (None if there is none)."""
    done = [p.parent for p in Path(root).glob("step-*/meta.json")]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def load_checkpoint(path: str | Path, trainer: Trainer) -> None:
    """Restore weights, optimizer, version and trajectory buffer into a freshly built trainer."""
    path = Path(path)
    if not (path / "meta.json").exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
    state = torch.load(path / "trainer.pt", weights_only=False)
    trainer.core.backend.load_state_dict(state["backend"])
    trainer.buffer.load_state_dict(orjson.loads((path / "buffer.json").read_bytes()))
    trainer.version = int(state["version"])
