"""Advantages, the trajectory buffer (complete groups, oldest version first), stream packing and the claim queue."""

from __future__ import annotations

import random
import threading

import pytest

from gyre_eval.groups import group_advantages
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.packing import PackingConfig, StreamPackingBuffer, materialize, pack_rows
from gyre_train.queue import MicroStepQueue
from gyre_train.testing.synthetic import make_groups, make_trajectory, placeholder
from gyre_train.types import ExecutionPartial, PrepassResult, TokenStats, TrainResult


def test_grpo_uses_population_std_and_mean_only_option():
    a = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert a == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # population std = 0.5
    assert group_advantages([3.0, 1.0], mode="mean") == [1.0, -1.0]
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="mode"):
        group_advantages([1.0], mode="rloo")


def _fill(buffer, groups):
    for gid, v, execs in groups:
        for eid, r, trajs in execs:
            buffer.add_execution(gid, v, eid, r, trajs)


def test_trajectory_buffer_complete_groups_oldest_version_first():
    buf = TrajectoryBuffer(2)
    rng = random.Random(0)
    t = lambda e, g: [make_trajectory(rng, e, g, 0, 20)]  # noqa: E731
    assert buf.add_execution("new", 3, "n0", 1.0, t("n0", "new")) is None
    assert buf.pop_ready() is None  # incomplete groups are never handed out
    buf.add_execution("old", 1, "o0", 0.0, t("o0", "old"))
    assert buf.add_execution("new", 3, "n1", 0.0, t("n1", "new")).group_id == "new"
    buf.add_execution("old", 1, "o1", 1.0, [placeholder("o1", "old")])
    buf.add_execution("old2", 1, "p0", 1.0, [])
    buf.add_execution("old2", 1, "p1", 1.0, [])
    assert [buf.pop_ready().group_id for _ in range(3)] == ["old", "old2", "new"]  # version, then readiness
    with pytest.raises(ValueError, match="already complete"):
        buf.add_execution("old", 1, "o2", 1.0)
    buf.add_execution("x", 0, "x0", 1.0)
    with pytest.raises(ValueError, match="dispatched at version 0"):
        buf.add_execution("x", 1, "x1", 1.0)
    with pytest.raises(ValueError, match="already added"):
        buf.add_execution("x", 0, "x0", 1.0)
    with pytest.raises(ValueError, match="added under"):
        buf.add_execution("x", 0, "x1", 1.0, t("zz", "x"))
    buf.drop_group("x")
    assert buf.num_pending == 0
    with pytest.raises(KeyError):
        buf.drop_group("x")


def test_materialize_aligns_targets_with_labels():
    rng = random.Random(1)
    traj = make_trajectory(rng, "e", "g", 0, 30)
    row = materialize(traj)
    last = max(p for p, m in enumerate(traj.target_mask) if m)
    assert len(row) == last  # trailing context is cut
    for p in range(len(row)):
        assert row.labels[p] == traj.token_ids[p + 1]
        assert row.target[p] == bool(traj.target_mask[p + 1])
        assert row.behavior_logprobs[p] == traj.behavior_logprobs[p + 1]
    assert materialize(placeholder("e", "g")) is None


def test_pack_rows_first_fit_decreasing():
    class R:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    bins = pack_rows([R(n) for n in [5, 3, 7, 2, 12, 1]], capacity=10)
    assert [[len(r) for r in b] for b in bins] == [[12], [7, 3], [5, 2, 1]]


def test_stream_packing_selects_groups_incrementally_and_closes_after_last_microstep():
    n, b = 4, 5
    buf = TrajectoryBuffer(n)
    groups = make_groups(b + 1, n, seed=2, max_len=120)
    _fill(buf, groups[:2])
    cfg = PackingConfig(group_size=n, batch_groups=b, tokens_per_shard=100, dp_size=2, window_shards=2)
    packer = StreamPackingBuffer(cfg, buf)
    packer.open_batch(0, 0)
    out = []
    while more := packer.next_microsteps():
        out += more
    assert len(packer.groups) == 2 and not packer.closed  # only 2 ready: waits for more
    _fill(buf, groups[2:])
    while not packer.closed:
        out += packer.next_microsteps()
    assert len(packer.groups) == b and buf.num_ready == 1  # exactly B groups, the 6th stays in the buffer
    assert [m.index for m in out] == list(range(len(out)))
    assert all(len(m.shards) == 2 and m.norm == n * b for m in out)
    # every target of every selected execution is emitted exactly once, with |T_i| = its total
    seen = {}
    for m in out:
        for s in m.shards:
            for slot in s.exec_slot:
                if slot >= 0:
                    e = m.executions[slot]
                    seen[e.execution_id] = seen.get(e.execution_id, 0) + 1
    infos = {e.execution_id: e for e in packer.executions}
    assert len(infos) == n * b
    assert all(seen.get(k, 0) == e.num_targets for k, e in infos.items())
    assert all(m.shards[0].num_tokens <= 120 for m in out)
    assert packer.next_microsteps() == []


def test_queue_releases_train_items_after_prepass_and_claims_are_atomic():
    n = 3
    buf = TrajectoryBuffer(n)
    _fill(buf, make_groups(2, n, seed=5, max_len=80))
    packer = StreamPackingBuffer(PackingConfig(group_size=n, batch_groups=2, tokens_per_shard=40), buf)
    packer.open_batch(0, 0)
    q = MicroStepQueue(single_pass=False)
    q.open(0)
    mss = []
    while not packer.closed:
        mss += packer.next_microsteps()
    for m in mss:
        q.put(m)
    q.close()
    # claims from many threads: each micro-step handed out exactly once
    claimed, lock = [], threading.Lock()

    def grab(cell):
        while (item := q.claim(cell)) is not None:
            with lock:
                claimed.append(item)
                holders[item.microstep.index] = cell

    holders = {}
    threads = [threading.Thread(target=grab, args=(c,)) for c in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(i.microstep.index for i in claimed) == list(range(len(mss)))
    assert all(i.kind == "prepass" for i in claimed)
    assert q.claim(0) is None and not q.finished
    # report the pre-pass (log ratio 0.01 per target): train items appear with the final sums
    for item in claimed:
        ms = item.microstep
        counts = {}
        for s in ms.shards:
            for slot in s.exec_slot:
                if slot >= 0:
                    counts[slot] = counts.get(slot, 0) + 1
        parts = [
            ExecutionPartial(execution_id=ms.executions[k].execution_id, log_ratio_sum=0.01 * c, count=c)
            for k, c in counts.items()
        ]
        q.report_prepass(PrepassResult(batch=0, index=ms.index, cell=holders[ms.index], partials=parts))
    trains = []
    while (item := q.claim(1)) is not None:
        trains.append(item)
    assert len(trains) == len(mss) and all(i.kind == "train" for i in trains)
    for i in trains:
        for e in i.microstep.executions:
            assert e.log_ratio_sum == pytest.approx(0.01 * e.num_targets)
        q.report_train(TrainResult(batch=0, index=i.microstep.index, cell=1, stats=TokenStats(num_targets=1)))
    assert q.finished and q.token_stats.num_targets == len(mss)
    with pytest.raises(ValueError, match="batch 3"):
        q.report_train(TrainResult(batch=3, index=0, cell=1, stats=TokenStats()))


def test_trajectory_buffer_concurrent_adds_and_pops():
    buf = TrajectoryBuffer(3)
    popped, lock, stop = [], threading.Lock(), threading.Event()

    def add(k):
        for g in range(k, 200, 4):
            for i in range(3):
                buf.add_execution(f"g{g}", g % 7, f"g{g}-{i}", float(i))

    def pop():
        while not stop.is_set() or buf.num_ready:
            group = buf.pop_ready()
            if group is not None:
                with lock:
                    popped.append(group.group_id)

    poppers = [threading.Thread(target=pop) for _ in range(2)]
    adders = [threading.Thread(target=add, args=(k,)) for k in range(4)]
    for t in poppers + adders:
        t.start()
    for t in adders:
        t.join()
    stop.set()
    for t in poppers:
        t.join()
    assert sorted(popped) == sorted(f"g{g}" for g in range(200))  # each complete group exactly once
