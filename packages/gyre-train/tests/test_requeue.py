"""Lost cells: the queue requeues a dropped cell's work and refuses its late reports; the coordinator drops
satellites whose control connection closes or whose claim lease expires."""

from __future__ import annotations

import time

import pytest

from gyre_train.buffer import TrajectoryBuffer
from gyre_train.errors import LateReport
from gyre_train.packing import PackingConfig, StreamPackingBuffer
from gyre_train.queue import MicroStepQueue
from gyre_train.testing.synthetic import make_groups
from gyre_train.types import ExecutionPartial, PrepassResult, TokenStats, TrainResult


def _microsteps(groups=2, n=3, seed=5):
    buf = TrajectoryBuffer(n)
    for gid, v, execs in make_groups(groups, n, seed=seed, max_len=80):
        for eid, r, trajs in execs:
            buf.add_execution(gid, v, eid, r, trajs)
    packer = StreamPackingBuffer(PackingConfig(group_size=n, batch_groups=groups, tokens_per_shard=40), buf)
    packer.open_batch(0, 0)
    mss = []
    while not packer.closed:
        mss += packer.next_microsteps()
    return mss


def _prepass(ms, cell):
    counts = {}
    for s in ms.shards:
        for slot in s.exec_slot:
            if slot >= 0:
                counts[slot] = counts.get(slot, 0) + 1
    parts = [
        ExecutionPartial(execution_id=ms.executions[k].execution_id, log_ratio_sum=0.01 * c, count=c)
        for k, c in counts.items()
    ]
    return PrepassResult(batch=0, index=ms.index, cell=cell, partials=parts)


def _targets(ms):
    return sum(int(x >= 0) for s in ms.shards for x in s.exec_slot)


def _train(ms, cell):
    # loss = micro-step index: the batch total is exact only if every micro-step counts exactly once
    return TrainResult(
        batch=0, index=ms.index, cell=cell, stats=TokenStats(loss=float(ms.index), num_targets=_targets(ms))
    )


def test_dropped_cell_work_returns_late_reports_are_refused_totals_exact():
    mss = _microsteps()
    assert len(mss) >= 4
    q = MicroStepQueue(single_pass=False)
    q.open(0)
    for m in mss:
        q.put(m)
    q.close()
    total = len(mss)
    a, b, c = q.claim(1), q.claim(2), q.claim(2)
    assert (a.kind, b.kind, c.kind) == ("prepass",) * 3
    q.report_prepass(_prepass(a.microstep, 1))
    with pytest.raises(LateReport, match="cell 2 holds it"):  # only the holder may report
        q.report_prepass(_prepass(b.microstep, 1))
    requeued = q.drop_cell(2)  # cell 2 dies holding two pre-pass claims
    assert [(i.kind, i.microstep.index) for i in requeued] == [
        ("prepass", b.microstep.index),
        ("prepass", c.microstep.index),
    ]
    assert q.unclaimed == total - 1
    with pytest.raises(LateReport):
        q.report_prepass(_prepass(b.microstep, 2))  # late: refused, nothing counted
    again = q.claim(0)
    assert (again.kind, again.microstep.index) == ("prepass", b.microstep.index)  # requeued work goes first
    q.report_prepass(_prepass(again.microstep, 0))
    held = []  # train items cell 0 claims on the way (reported at the end)
    while (item := q.claim(0)) is not None:
        if item.kind == "prepass":
            q.report_prepass(_prepass(item.microstep, 0))
        else:
            held.append(item)
        if all(t.final for t in q.tallies().values()):
            break  # every pre-pass is in: leave the released train items for cell 1
    # every execution's pre-pass sum is exact: the dropped claims were not counted twice
    for t in q.tallies().values():
        assert t.count == t.info.num_targets
        assert t.log_ratio_sum == pytest.approx(0.01 * t.info.num_targets)
    # cell 1 trains two micro-steps (reports one), then its lease expires: both go back
    x, y = q.claim(1), q.claim(1)
    assert (x.kind, y.kind) == ("train", "train")
    q.report_train(_train(x.microstep, 1))
    assert q.trained_by_cell == {1: 1}
    back = q.drop_cell(1)
    assert sorted(i.microstep.index for i in back) == sorted([x.microstep.index, y.microstep.index])
    assert all(i.kind == "train" for i in back) and q.trained_by_cell == {} and q.outstanding == total
    assert back[0].microstep.executions[0].log_ratio_sum is not None  # the final s_i sums travel with it
    for late in (x, y):
        with pytest.raises(LateReport, match="nobody holds it"):
            q.report_train(_train(late.microstep, 1))
    for item in held:
        q.report_train(_train(item.microstep, 0))
    while (item := q.claim(0)) is not None:
        q.report_train(_train(item.microstep, 0))
    assert q.finished and q.trained_by_cell == {0: total}
    stats = q.token_stats
    assert stats.loss == float(sum(m.index for m in mss))
    assert stats.num_targets == sum(_targets(m) for m in mss)


def test_single_pass_partials_of_a_dropped_train_report_are_not_counted():
    mss = _microsteps()
    q = MicroStepQueue(prepass=False)
    q.open(0)
    q.put(mss[0])
    q.close()
    item = q.claim(3)
    ex = mss[0].executions[0].execution_id
    part = [ExecutionPartial(execution_id=ex, log_ratio_sum=0.5, count=2)]
    q.report_train(TrainResult(batch=0, index=0, cell=3, stats=TokenStats(num_targets=2), partials=part))
    assert q.tallies()[ex].count == 2 and q.finished
    q.drop_cell(3)
    assert not q.finished and q.tallies()[ex].count == 0 and q.token_stats.num_targets == 0
    assert q.claim(0).microstep == item.microstep
    q.report_train(TrainResult(batch=0, index=0, cell=0, stats=TokenStats(num_targets=2), partials=part))
    assert q.finished and q.tallies()[ex].count == 2 and q.token_stats.num_targets == 2


def test_coordinator_drops_an_expired_lease_and_a_closed_connection(tiny_model, tmp_path):
    from multiprocessing.connection import Client

    from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
    from gyre_train.cell import CellWorker
    from gyre_train.loss import LossConfig
    from gyre_train.multicell import Coordinator, MultiCellConfig
    from gyre_train.ports import free_port
    from gyre_train.trainer import Trainer, TrainerConfig
    from gyre_train.types import CellRequest

    with pytest.raises(ValueError, match="claim_timeout_s"):
        MultiCellConfig(num_cells=2, master_port=1, control_port=1, snapshot_dir=".", claim_timeout_s=0)
    buffer = TrajectoryBuffer(2)
    for gid, v, execs in make_groups(1, 2, seed=1, max_len=30):
        for eid, r, trajs in execs:
            buffer.add_execution(gid, v, eid, r, trajs)
    trainer = Trainer(
        TrainerConfig(packing=PackingConfig(group_size=2, batch_groups=1, tokens_per_shard=16)),
        CellWorker(0, TorchBackend(TorchBackendConfig(model_path=tiny_model)), LossConfig()),
        buffer,
    )
    cfg = MultiCellConfig(
        num_cells=3, master_port=1, control_port=free_port(), snapshot_dir=str(tmp_path), claim_timeout_s=0.2
    )
    now = [1000.0]  # the leases' clock: moved by hand, so no wait decides the outcome
    coord = Coordinator(cfg, trainer, clock=lambda: now[0])
    try:
        coord.open_batch(0, str(tmp_path / "snap.pt"))
        trainer.open_batch()
        assert coord.handle(CellRequest(op="join", cell=1)).status == "joined"
        assert coord.handle(CellRequest(op="join", cell=2)).status == "joined"
        got = coord.handle(CellRequest(op="claim", cell=1))
        assert got.status == "item"
        unclaimed = trainer.queue.unclaimed
        now[0] += 0.1
        assert coord.expire_leases() == []  # within the lease (claimed at 1000.0, deadline 1000.2)
        now[0] += 0.15
        assert coord.expire_leases() == [1]  # past it
        assert trainer.queue.unclaimed == unclaimed + 1 and coord.participants == {0, 2}
        ms = got.item.microstep
        late = PrepassResult(batch=0, index=ms.index, cell=1, partials=[])
        assert coord.handle(CellRequest(op="report", cell=1, prepass=late)).status == "dropped"
        assert coord.lost == [(0, 1, "claim lease expired (0.2 s)", 1)]
        assert coord.handle(CellRequest(op="join", cell=1)).status == "joined"  # alive: may join again
        # cell 2 opens a real control connection, claims, and its process "dies" (connection closed)
        conn = Client((cfg.host, cfg.control_port), authkey=cfg.authkey.encode())
        conn.send_bytes(CellRequest(op="claim", cell=2).model_dump_json().encode())
        assert b'"item"' in conn.recv_bytes()
        conn.close()
        deadline = time.monotonic() + 10
        while coord.participants != {0, 1} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert coord.participants == {0, 1} and coord.lost[-1][1:] == (2, "control connection closed", 1)
        assert coord.live_cells() == [0, 1]
        stop = coord.handle(CellRequest(op="claim", cell=2))
        assert (stop.status, stop.members) == ("stop", [0, 1])  # a dead cell never rejoins
        assert coord.close_window(broadcast=False) == [0, 1]
        done = coord.handle(CellRequest(op="claim", cell=1))
        assert (done.status, done.prefix, done.members) == ("batch_done", 2, [0, 1])
    finally:
        coord.close()
