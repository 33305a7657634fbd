"""Batch dumps and their single-cell replay (in process; the real multi-process check is in test_multicell.py)."""

from __future__ import annotations

import pytest
import torch

from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.loss import LossConfig
from gyre_train.packing import PackingConfig
from gyre_train.replay import dump_batch, load_dump, replay_batch
from gyre_train.testing.synthetic import make_groups
from gyre_train.trainer import Trainer, TrainerConfig

N, B = 3, 2


def _trainer(model: str, loss: LossConfig, cells: int = 2) -> tuple[Trainer, list[CellWorker]]:
    buffer = TrajectoryBuffer(N)
    for gid, v, execs in make_groups(2 * B, N, seed=41, max_len=50):
        for eid, r, trajs in execs:
            buffer.add_execution(gid, v, eid, r, trajs)
    cfg = TrainerConfig(packing=PackingConfig(group_size=N, batch_groups=B, tokens_per_shard=48), loss=loss)
    workers = [
        CellWorker(
            c, TorchBackend(TorchBackendConfig(model_path=model, dtype="float64", optimizer=c == 0)), loss
        )
        for c in range(cells)
    ]
    return Trainer(cfg, workers[0], buffer), workers[1:]


@pytest.mark.parametrize("ratio_reference", ["behaviour", "proximal"])
def test_dumped_two_cell_batch_replays_on_one_cell(tiny_model, tmp_path, ratio_reference):
    loss = LossConfig(ratio_reference=ratio_reference)
    trainer, sats = _trainer(tiny_model, loss)
    trainer.step(satellites=sats, join_after=1)  # step 0, not dumped
    before = trainer.core.backend.flat_params()
    report = trainer.step(satellites=sats, join_after=1, dump_dir=tmp_path / "b1")
    dump = load_dump(tmp_path / "b1")
    assert torch.equal(dump.params_before, before)  # the weights batch 1 was trained at (after step 0)
    assert dump.report == report and report.microsteps_by_cell.get(1, 0) >= 1
    assert [m.index for m in dump.microsteps] == list(range(report.num_microsteps))
    assert {m.batch for m in dump.microsteps} == {1}
    # train items carry their final s_i sums (or compute them: single pass)
    if ratio_reference == "behaviour":
        assert any(e.log_ratio_sum is not None for m in dump.microsteps for e in m.executions)
    loss_r, grads = replay_batch(tmp_path / "b1", tiny_model, dtype="float64", loss=loss)
    assert loss_r == pytest.approx(report.loss, abs=1e-12, rel=1e-9)
    assert torch.allclose(grads, dump.summed_grads, atol=1e-12, rtol=1e-9)
    assert float(grads.abs().max()) > 1e-4
    # another temperature is another batch: the replay follows the override
    loss_t, _ = replay_batch(tmp_path / "b1", tiny_model, dtype="float64", loss=loss, temperature=0.5)
    assert abs(loss_t - report.loss) > 1e-6


def test_dump_refuses_empty_or_mixed_batches_and_replay_needs_a_complete_dump(tiny_model, tmp_path):
    trainer, _ = _trainer(tiny_model, LossConfig(), cells=1)
    report = trainer.step(dump_dir=tmp_path / "b0")
    dump = load_dump(tmp_path / "b0")
    kw = dict(params_before=dump.params_before, summed_grads=dump.summed_grads, report=report)
    with pytest.raises(ValueError, match="needs the batch's train items"):
        dump_batch(tmp_path / "x", microsteps=[], **kw)
    other = dump.microsteps[0].model_copy(update={"batch": 7})
    with pytest.raises(ValueError, match=r"several batches: \[0, 7\]"):
        dump_batch(tmp_path / "x", microsteps=[dump.microsteps[0], other], **kw)
    with pytest.raises(FileNotFoundError, match=r"no meta\.json"):
        replay_batch(tmp_path / "x", tiny_model)
    loss, grads = replay_batch(tmp_path / "b0", tiny_model)
    assert loss == pytest.approx(report.loss, abs=1e-12, rel=1e-9)
    assert torch.allclose(grads, dump.summed_grads, atol=1e-12, rtol=1e-9)
