"""The core's per-step checkpoints: what `gyre run --resume RUN` continues from after the controller was killed.

Layout, under ``RUN/checkpoints/trainer/``::

    step-<V>/trainer.pt, buffer.json, meta.json   gyre_train.checkpoint: weights + optimizer state, version V
    step-<V>/hf/                                  the policy of version V as a Hugging Face checkpoint (+ tokenizer):
                                                  every cell and engine of the resumed run starts from it
    step-<V>/report.json                          the step's StepReport (a step killed before the controller
                                                  recorded it is still recorded on resume)

A checkpoint is written under ``.partial/`` and renamed into place when complete, so ``step-<V>`` is either whole
or absent, whatever moment the process is killed at. The core writes it after the optimizer step and before it
reports the step, so a step in metrics/steps.jsonl always has its checkpoint. Only the last ``keep`` are kept.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import orjson
import torch

from gyre_train.checkpoint import latest_checkpoint, save_checkpoint
from gyre_train.trainer import Trainer

__all__ = ["latest_step_checkpoint", "load_step_checkpoint", "write_step_checkpoint"]


def _version(path: Path) -> int:
    return int(path.name.split("-")[1])


def write_step_checkpoint(
    root: Path, trainer: Trainer, save_hf: Callable[[Path], None], report: dict, keep: int
) -> Path:
    """Write ``root/step-<trainer.version>`` atomically, then drop all but the newest ``keep`` step checkpoints."""
    partial = root / ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # what a killed writer left
    staged = save_checkpoint(partial, trainer)
    save_hf(staged / "hf")
    (staged / "report.json").write_bytes(orjson.dumps(report))
    out = root / staged.name
    if out.exists():  # written again for the same version (the final save after the last step)
        shutil.rmtree(out)
    os.replace(staged, out)
    shutil.rmtree(partial, ignore_errors=True)
    done = sorted((p for p in root.glob("step-*") if (p / "meta.json").exists()), key=_version)
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def latest_step_checkpoint(root: Path) -> Path | None:
    """The newest complete step checkpoint with its HF policy (None: no step was checkpointed)."""
    path = latest_checkpoint(root)
    return path if path is not None and (path / "hf" / "config.json").exists() else None


def load_step_checkpoint(path: Path, backend) -> int:
    """Weights and optimizer state into a freshly built backend; returns the checkpoint's policy version.

    The trajectory buffer is not restored: the groups it held belong to the killed controller's scheduler, which
    the resumed run does not continue (it accounts them as dropped and dispatches new groups).
    """
    state = torch.load(path / "trainer.pt", weights_only=False)
    backend.load_state_dict(state["backend"])
    return int(state["version"])
