"""Resume from a checkpoint gives an identical next step (weights, Adam state, version, buffer hand-out order)."""

from __future__ import annotations

import pytest
import torch

from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gyre_train.loss import LossConfig
from gyre_train.packing import PackingConfig
from gyre_train.testing.synthetic import make_groups
from gyre_train.trainer import Trainer, TrainerConfig

N, B = 3, 2


def _trainer(model_path: str, fill: bool) -> Trainer:
    buffer = TrajectoryBuffer(N)
    if fill:
        for gid, v, execs in make_groups(3 * B, N, seed=3, max_len=40):
            for eid, r, trajs in execs:
                buffer.add_execution(gid, v, eid, r, trajs)
        # an incomplete group survives the checkpoint
        buffer.add_execution("partial", 0, "partial-x0", 1.0, [])
    backend = TorchBackend(TorchBackendConfig(model_path=model_path, lr=1e-3))
    cfg = TrainerConfig(
        packing=PackingConfig(group_size=N, batch_groups=B, tokens_per_shard=48, window_shards=2)
    )
    return Trainer(cfg, CellWorker(0, backend, LossConfig()), buffer)


def test_resume_gives_identical_next_step(tiny_model, tmp_path):
    a = _trainer(tiny_model, fill=True)
    events = []
    a.on_event = lambda ev, fields: events.append((ev, fields))
    first = a.step()
    assert events[0] == ("batch_open", {"batch": 0})
    claims = [f for ev, f in events if ev == "microstep_claim"]
    assert len([c for c in claims if c["kind"] == "train"]) == first.num_microsteps and claims[0]["cell"] == 0
    assert events[-1] == ("step_end", {"version": 1, "groups": first.group_ids, "staleness": first.staleness})
    ckpt = save_checkpoint(tmp_path / "checkpoints", a)
    assert latest_checkpoint(tmp_path / "checkpoints") == ckpt
    ra = a.step()
    pa = a.core.backend.flat_params()

    b = _trainer(tiny_model, fill=False)
    assert not torch.equal(b.core.backend.flat_params(), pa)
    load_checkpoint(ckpt, b)
    assert b.version == 1 and b.buffer.num_ready == 2 * B and b.buffer.num_pending == 1
    rb = b.step()
    assert torch.equal(b.core.backend.flat_params(), pa)  # bit-identical update (Adam moments restored too)
    assert rb.group_ids == ra.group_ids and rb.loss == ra.loss and rb.grad_norm == ra.grad_norm
    assert rb.model_dump(exclude={"seconds"}) == ra.model_dump(exclude={"seconds"})


def test_checkpoint_refused_inside_a_batch_and_incomplete_ones_ignored(tiny_model, tmp_path):
    t = _trainer(tiny_model, fill=True)
    t.open_batch()
    with pytest.raises(RuntimeError, match="between steps"):
        save_checkpoint(tmp_path, t)
    (tmp_path / "step-9").mkdir()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match=r"meta\.json"):
        load_checkpoint(tmp_path / "step-9", t)
