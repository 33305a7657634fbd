"""Pluggable weight snapshots, satellites that leave training and come back (run_burst), the scheduler's `final`."""

from __future__ import annotations

import json

import pytest
import torch

from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.errors import SnapshotError
from gyre_train.localrun import LocalRunSpec, launch
from gyre_train.loss import LossConfig
from gyre_train.multicell import Coordinator, CoreRunner, MultiCellConfig, PrefixGroups
from gyre_train.packing import PackingConfig
from gyre_train.ports import free_port
from gyre_train.replay import load_dump, replay_batch
from gyre_train.snapshot import FileSnapshotChannel, SnapshotChannel
from gyre_train.testing.synthetic import make_groups
from gyre_train.trainer import Trainer, TrainerConfig
from gyre_train.types import CellRequest, TokenStats, TrainResult


def test_file_snapshot_channel_publishes_atomically_and_refuses_stale_refs(tmp_path):
    core, sat = FileSnapshotChannel(tmp_path / "s"), FileSnapshotChannel(tmp_path / "s")
    assert isinstance(core, SnapshotChannel)
    a, b = torch.arange(6, dtype=torch.float64), torch.linspace(-1, 1, 6, dtype=torch.float64)
    ref0 = core.publish(0, a)
    a += 100  # the published snapshot is a copy: fixed during accumulation
    assert torch.equal(sat.load(ref0), torch.arange(6, dtype=torch.float64))
    ref1 = core.publish(1, b)
    assert torch.equal(sat.load(ref1), b)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["snapshot-1.pt"]  # previous one removed
    with pytest.raises(SnapshotError, match=r"stale snapshot .*snapshot-0\.pt"):
        sat.load(ref0)
    with pytest.raises(ValueError, match="not a file snapshot reference"):
        sat.load(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="batch must be >= 0"):
        core.publish(-1, b)
    core.close()


class _MemoryChannel:
    """A SnapshotChannel that records what the core publishes."""

    def __init__(self) -> None:
        self.published: dict[int, torch.Tensor] = {}

    def publish(self, batch: int, params: torch.Tensor) -> str:
        self.published[batch] = params.clone()
        return f"mem:{batch}"

    def load(self, ref: str) -> torch.Tensor:
        return self.published[int(ref.split(":")[1])]

    def close(self) -> None:
        pass


def _trainer(model: str, groups: int = 1, loss: LossConfig | None = None) -> Trainer:
    buffer = TrajectoryBuffer(2)
    for gid, v, execs in make_groups(groups, 2, seed=35, max_len=30):  # unequal rewards in both groups
        for eid, r, trajs in execs:
            buffer.add_execution(gid, v, eid, r, trajs)
    cfg = TrainerConfig(
        packing=PackingConfig(group_size=2, batch_groups=1, tokens_per_shard=16), loss=loss or LossConfig()
    )
    backend = TorchBackend(TorchBackendConfig(model_path=model, dtype="float64"))
    return Trainer(cfg, CellWorker(0, backend, cfg.loss), buffer)


def test_core_publishes_each_batch_through_its_channel(tiny_model, tmp_path):
    trainer = _trainer(tiny_model, groups=2)
    channel = _MemoryChannel()
    mc = MultiCellConfig(
        num_cells=1, master_port=1, control_port=free_port(), snapshot_dir=str(tmp_path / "x")
    )
    core = CoreRunner(mc, trainer, PrefixGroups(1), snapshots=channel)
    try:
        before = trainer.core.backend.flat_params()
        core.step(final=False)
        after = trainer.core.backend.flat_params()
        core.step()
    finally:
        core.coordinator.close()
    assert sorted(channel.published) == [0, 1]
    assert torch.equal(channel.published[0], before) and torch.equal(channel.published[1], after)
    assert not torch.equal(before, after)
    assert not (tmp_path / "x").exists()  # the default file channel was not used


def test_coordinator_leave_requeues_inside_a_batch_and_reduces_first_after_the_window(tiny_model, tmp_path):
    trainer = _trainer(tiny_model, loss=LossConfig(ratio_reference="proximal"))  # train items only
    cfg = MultiCellConfig(num_cells=3, master_port=1, control_port=free_port(), snapshot_dir=str(tmp_path))
    coord = Coordinator(cfg, trainer)
    try:
        coord.open_batch(0, "ref-0")
        trainer.open_batch()
        assert coord.handle(CellRequest(op="join", cell=1)).status == "joined"
        item = coord.handle(CellRequest(op="claim", cell=1)).item
        done = TrainResult(batch=0, index=item.microstep.index, cell=1, stats=TokenStats(num_targets=1))
        nxt = coord.handle(CellRequest(op="report", cell=1, train=done))
        assert nxt.status == "item" and trainer.queue.trained_by_cell == {1: 1}
        # it leaves (here even holding a claim): its reported and claimed items go back, it is told directly
        left = coord.handle(CellRequest(op="leave", cell=1))
        assert (left.status, left.batch) == ("ok", 0)
        assert trainer.queue.trained_by_cell == {}
        assert coord.participants == {0} and coord.lost == [(0, 1, "left training", 2)]
        back = [trainer.queue.claim(0).microstep.index for _ in range(2)]  # requeued at the front, in order
        assert back == sorted([item.microstep.index, nxt.item.microstep.index])
        assert coord.handle(CellRequest(op="claim", cell=1)).status == "wait"  # out, not `dropped`
        assert coord.handle(CellRequest(op="join", cell=2)).status == "wait"  # cell 1 is not training
        assert coord.handle(CellRequest(op="join", cell=1)).status == "joined"  # it may come back
        # the window closes with it inside: a leave is answered batch_done (it must reduce), then it is out
        assert coord.close_window(broadcast=True) == [0, 1]
        owed = coord.handle(CellRequest(op="leave", cell=1))
        assert (owed.status, owed.members, owed.broadcast) == ("batch_done", [0, 1], True)
        assert coord.handle(CellRequest(op="leave", cell=1)).status == "ok"
        coord.open_batch(1, "ref-1")
        assert coord.participants == {0}  # a broadcast receiver that left is not carried into the next batch
    finally:
        coord.close()
    with pytest.raises(ValueError, match="carries no result"):
        CellRequest(op="leave", cell=1, train=done)


@pytest.mark.slow
def test_satellite_leaves_after_a_broadcast_and_rejoins_mid_batch(tiny_model, tmp_path):
    # step 0: cell 1 joins before the core's 2nd item; final=False -> broadcast, it stays; then it leaves.
    # step 1 (final) opens without it; it joins again before the core's 2nd item; the burst ends; then stop.
    spec = LocalRunSpec(
        model_path=tiny_model,
        out_dir=str(tmp_path),
        num_cells=2,
        steps=2,
        wait_join_at=1,
        save_grads=True,
        dump_steps=(0, 1),
        scenario="leave_rejoin",
    )
    assert launch(spec, timeout=240) == [0, 0]
    sat = json.loads((tmp_path / "satellite-1.json").read_text())
    assert sat["bursts"] == ["left", "burst_end", "stop"]
    assert sat["items"][0] >= 1 and sat["items"][1] >= 1
    reports = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    for step, report in enumerate(reports):
        by_cell = {int(k): v for k, v in report["microsteps_by_cell"].items()}
        assert by_cell.get(1, 0) >= 1 and by_cell[0] >= 1, (step, by_cell)
        # the single-cell recomputation of the dumped batch equals what the two processes computed
        loss, grads = replay_batch(
            tmp_path / f"dump-{step}", tiny_model, dtype="float64", loss=LossConfig(), temperature=1.0
        )
        summed = torch.load(tmp_path / f"grads-{step}.pt")
        assert loss == pytest.approx(report["loss"], abs=1e-9)
        assert torch.allclose(grads, summed, atol=1e-6, rtol=0) and float(grads.abs().max()) > 1e-4
    # step 1 trained at the updated weights (the rejoining satellite loaded them from the new snapshot)
    p0, p1 = load_dump(tmp_path / "dump-0").params_before, load_dump(tmp_path / "dump-1").params_before
    assert float((p1 - p0).abs().max()) > 1e-7
    assert [r["policy_version"] for r in reports] == [1, 2]


def test_satellite_runner_leaves_while_waiting_and_after_a_stale_snapshot(tiny_model, tmp_path):
    import threading

    from gyre_train.satellite import SatelliteRunner

    trainer = _trainer(tiny_model)
    trainer.buffer.pop_ready()  # the batch will starve: the satellite joins and finds no work
    cfg = MultiCellConfig(
        num_cells=2, master_port=1, control_port=free_port(), snapshot_dir=str(tmp_path / "s"), poll_s=0.001
    )
    coord = Coordinator(cfg, trainer)
    sat_backend = TorchBackend(TorchBackendConfig(model_path=tiny_model, dtype="float64", optimizer=False))
    runner = SatelliteRunner(cfg, CellWorker(1, sat_backend, LossConfig()), groups=None)
    channel = FileSnapshotChannel(tmp_path / "s")
    try:
        leave = threading.Event()
        leave.set()
        assert runner.run_burst(leave) == "left"  # waiting to join: nothing to undo
        leave.clear()
        result: list[str] = []
        burst = threading.Thread(target=lambda: result.append(runner.run_burst(leave)))
        burst.start()  # no batch open: it waits to join
        snapshot = trainer.core.backend.flat_params() + 0.5
        coord.open_batch(0, channel.publish(0, snapshot))
        trainer.open_batch()
        coord.wait_joined(1, timeout=60)  # joined, then waits for work that never comes
        leave.set()
        burst.join(60)
        assert result == ["left"] and coord.participants == {0} and not runner.joined
        assert torch.equal(sat_backend.flat_params(), snapshot)  # it had loaded the batch's snapshot
        assert runner.items_run == 0
        # a snapshot that cannot be read: the satellite leaves the batch (the core never waits for it) and raises
        coord.open_batch(1, str(tmp_path / "s" / "snapshot-9.pt"))
        leave.clear()
        with pytest.raises(SnapshotError, match="stale snapshot"):
            runner.run_burst(leave)
        assert coord.participants == {0}
    finally:
        runner.conn.close()
        coord.close()


def test_wait_claimed_holds_until_the_satellite_claimed_not_just_joined(tiny_model, tmp_path):
    # the gate tests put before the core's second item: a joined satellite may still be loading the snapshot
    trainer = _trainer(tiny_model, loss=LossConfig(ratio_reference="proximal"))
    cfg = MultiCellConfig(num_cells=2, master_port=1, control_port=free_port(), snapshot_dir=str(tmp_path))
    coord = Coordinator(cfg, trainer)
    try:
        coord.open_batch(0, "ref-0")
        trainer.open_batch()
        assert coord.handle(CellRequest(op="join", cell=1)).status == "joined"
        coord.wait_joined(1, timeout=1)
        with pytest.raises(TimeoutError, match="cell 1 claimed no item"):
            coord.wait_claimed(1, timeout=0.01)
        assert coord.handle(CellRequest(op="claim", cell=1)).status == "item"
        coord.wait_claimed(1, timeout=0)  # returns at once
        coord.close_window(broadcast=False)
        coord.open_batch(1, "ref-1")  # a new batch forgets the claims of the last one
        with pytest.raises(TimeoutError):
            coord.wait_claimed(1, timeout=0.01)
    finally:
        coord.close()


def test_a_satellites_parameters_are_the_loaded_snapshot_itself(tiny_model) -> None:
    """`load_flat_params` aliases a snapshot of the backend's dtype: a channel that returns its own buffer
    (Mooncake across hosts) has the read land in the satellite's parameters, with no copy after the transfer."""
    backend = TorchBackend(TorchBackendConfig(model_path=tiny_model, dtype="float64", optimizer=False))
    flat = backend.flat_params() + 0.25
    backend.load_flat_params(flat)
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
    assert all(lo <= p.data_ptr() < hi for p in backend.params)
    flat += 1.0  # the next snapshot read into the same buffer is what the parameters hold
    assert torch.equal(backend.flat_params(), flat)
