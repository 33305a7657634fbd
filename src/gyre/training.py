"""The training side of a local run: the core's trainer, satellite workers, checkpoints and published weights.

On one CPU machine every cell's training worker lives in this process (the core owns the optimizer; satellites hold
their own model copy without one and load the core's weight snapshot when they join a batch). The multi-process
version with gloo between cells is `gyre_train.multicell`; the batch logic is the same `Trainer`.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from gyre_cell.roles import TorchTrainingState
from gyre_tito.types import Trajectory
from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.checkpoint import save_checkpoint
from gyre_train.loss import LossConfig
from gyre_train.packing import PackingConfig
from gyre_train.trainer import Trainer, TrainerConfig
from gyre_train.types import StepReport

__all__ = ["LocalTraining"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class LocalTraining:
    def __init__(self, model_dir: Path, run_dir: Path, *, cells: int, group_size: int, batch_groups: int,
                 lr: float, temperature: float) -> None:  # fmt: skip
        self.model_dir = model_dir
        self.run_dir = run_dir
        loss = LossConfig()
        core = CellWorker(0, TorchBackend(TorchBackendConfig(model_path=str(model_dir), lr=lr)), loss)
        self.satellites = [
            CellWorker(i, TorchBackend(TorchBackendConfig(model_path=str(model_dir), optimizer=False)), loss)
            for i in range(1, cells)
        ]
        self.buffer = TrajectoryBuffer(group_size)
        packing = PackingConfig(group_size=group_size, batch_groups=batch_groups, temperature=temperature)
        self.trainer = Trainer(TrainerConfig(packing=packing), core, self.buffer)
        self.batch_groups = batch_groups

    def cell_states(self) -> list[TorchTrainingState]:
        """Each cell's training state (model + optimizer) as the role manager offloads and restores it."""
        core = self.trainer.core.backend
        states = [TorchTrainingState(core.model, core.optimizer)]
        return states + [TorchTrainingState(w.backend.model, None) for w in self.satellites]

    @property
    def version(self) -> int:
        return self.trainer.version

    def add_execution(self, group_id: str, v_d: int, execution_id: str, reward: float,
                      trajectories: list[Trajectory]) -> None:  # fmt: skip
        self.buffer.add_execution(group_id, v_d, execution_id, reward, trajectories)

    def drop_group(self, group_id: str) -> None:
        with contextlib.suppress(
            KeyError
        ):  # a dropped group may have no assessed execution in the buffer yet
            self.buffer.drop_group(group_id)

    def batch_ready(self) -> bool:
        return self.buffer.num_ready >= self.batch_groups

    def step(self, training_cells: int) -> StepReport:
        """One optimizer step with the core and the satellites currently in training (blocking; run in a thread)."""
        return self.trainer.step(satellites=self.satellites[: max(0, training_cells - 1)], join_after=0)

    def publish(self, version: int) -> Path:
        """Write the current policy as a Hugging Face checkpoint engines can load (and a trainer checkpoint)."""
        out = self.run_dir / "checkpoints" / f"policy-v{version}"
        self.trainer.core.backend.model.save_pretrained(out)
        for name in _TOKENIZER_FILES:
            if (self.model_dir / name).exists():
                shutil.copy2(self.model_dir / name, out / name)
        save_checkpoint(self.run_dir / "checkpoints" / "trainer", self.trainer)
        return out
