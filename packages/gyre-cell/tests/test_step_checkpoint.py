"""The core's per-step checkpoints (gyre_cell.step_checkpoint): written whole or not at all, the last N kept, and a
fresh backend restored from one takes the same next step as the original (weights and Adam state both restored)."""

from __future__ import annotations

import orjson
import torch

from gyre_cell.step_checkpoint import latest_step_checkpoint, load_step_checkpoint, write_step_checkpoint
from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.loss import LossConfig
from gyre_train.packing import PackingConfig
from gyre_train.testing.synthetic import make_groups
from gyre_train.trainer import Trainer, TrainerConfig

N, B = 2, 1


def _trainer(model_path: str) -> Trainer:
    buffer = TrajectoryBuffer(N)
    for gid, v, execs in make_groups(4 * B, N, seed=5, max_len=24):
        for eid, r, trajs in execs:
            buffer.add_execution(gid, v, eid, r, trajs)
    backend = TorchBackend(TorchBackendConfig(model_path=model_path, lr=1e-3))
    cfg = TrainerConfig(packing=PackingConfig(group_size=N, batch_groups=B, tokens_per_shard=48))
    return Trainer(cfg, CellWorker(0, backend, LossConfig()), buffer)


def test_steps_checkpointed_atomically_last_two_kept_and_resumed_exactly(tiny_model, tmp_path):
    root = tmp_path / "trainer"
    a = _trainer(str(tiny_model))
    # what a writer killed mid-way left: never a checkpoint
    (root / ".partial" / "step-9").mkdir(parents=True)
    for _ in range(3):
        report = a.step().model_dump(mode="json")
        write_step_checkpoint(root, a, a.core.backend.save_hf_pretrained, report, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-3"]  # .partial gone, step-1 pruned
    latest = latest_step_checkpoint(root)
    assert latest == root / "step-3"
    assert orjson.loads((latest / "report.json").read_bytes())["policy_version"] == 3
    assert (latest / "hf" / "config.json").exists()
    after = a.step()

    # A fresh backend built from the checkpoint's HF policy, plus its optimizer state: the same next step.
    b = _trainer(str(latest / "hf"))
    assert load_step_checkpoint(latest, b.core.backend) == 3
    b.version = 3
    b.buffer.load_state_dict(orjson.loads((latest / "buffer.json").read_bytes()))  # the same next groups
    again = b.step()
    assert again.loss == after.loss and again.grad_norm == after.grad_norm
    assert torch.equal(b.core.backend.flat_params(), a.core.backend.flat_params())
