"""Trace events at the moment they happen: group_assigned before any claim of its micro-steps, lazy assignment of
groups arriving one by one while the core waits, and the core's wait ending in StepAborted."""

from __future__ import annotations

import threading

import pytest
import torch

from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.errors import DataStarvation, StepAborted
from gyre_train.loss import LossConfig
from gyre_train.multicell import CoreRunner, MultiCellConfig, PrefixGroups
from gyre_train.packing import PackingConfig
from gyre_train.ports import free_port
from gyre_train.testing.synthetic import make_groups
from gyre_train.trainer import Trainer, TrainerConfig

N, B = 2, 4


def _trainer(model: str, cell_count: int = 1) -> tuple[Trainer, list[CellWorker]]:
    packing = PackingConfig(group_size=N, batch_groups=B, tokens_per_shard=32, window_shards=1)
    workers = [
        CellWorker(
            c,
            TorchBackend(TorchBackendConfig(model_path=model, dtype="float64", optimizer=c == 0)),
            LossConfig(),
        )
        for c in range(cell_count)
    ]
    return Trainer(TrainerConfig(packing=packing), workers[0], TrajectoryBuffer(N)), workers[1:]


def _add(buffer: TrajectoryBuffer, group) -> None:
    gid, v, execs = group
    for eid, r, trajs in execs:
        buffer.add_execution(gid, v, eid, r, trajs)


def _check_claims(log: list) -> list[dict]:
    """Every claim has its fields and each of its groups was assigned earlier; returns the claims."""
    assigned: set[str] = set()
    claims = []
    for ev, f in log:
        if ev == "group_assigned":
            assigned.add(f["group_id"])
        elif ev == "microstep_claim":
            assert set(f) == {"cell", "kind", "batch", "index", "groups"}
            assert f["groups"] and f["groups"] == sorted(set(f["groups"]))
            assert set(f["groups"]) <= assigned, (f, assigned)
            claims.append(f)
    return claims


def test_groups_are_assigned_oldest_first_before_any_claim_of_their_microsteps(tiny_model):
    trainer, (sat,) = _trainer(tiny_model, 2)
    groups = make_groups(B, N, seed=21, max_len=40)
    versions = {groups[0][0]: 2, groups[1][0]: 0, groups[2][0]: 1, groups[3][0]: 0}
    for gid, _, execs in groups:
        _add(trainer.buffer, (gid, versions[gid], execs))
    log: list = []
    trainer.on_event = lambda ev, f: log.append((ev, dict(f)))
    trainer.version = 2
    report = trainer.step(satellites=[sat], join_after=1)
    assigned = [f for ev, f in log if ev == "group_assigned"]
    assert [f["group_id"] for f in assigned] == [groups[i][0] for i in (1, 3, 2, 0)]  # v_d 0, 0, 1, 2
    assert all(f["batch"] == 2 for f in assigned) and report.group_ids == [f["group_id"] for f in assigned]
    claims = _check_claims(log)
    assert {c["cell"] for c in claims} == {0, 1}
    trains = [c for c in claims if c["kind"] == "train"]
    assert sorted(c["index"] for c in trains) == list(range(report.num_microsteps))
    assert all(c["batch"] == 2 for c in claims)
    assert log[0] == ("batch_open", {"batch": 2}) and log[-1][0] == "step_end"
    # lazily: the first claim came before the last group was assigned (the batch spans several pulls)
    first_claim = next(i for i, (ev, _) in enumerate(log) if ev == "microstep_claim")
    last_assign = max(i for i, (ev, _) in enumerate(log) if ev == "group_assigned")
    assert first_claim < last_assign


def _core(trainer: Trainer, tmp_path, **kw) -> CoreRunner:
    mc = MultiCellConfig(
        num_cells=1, master_port=1, control_port=free_port(), snapshot_dir=str(tmp_path / "snapshots"), **kw
    )
    return CoreRunner(mc, trainer, PrefixGroups(1))  # one cell: no process group needed


def test_groups_arriving_one_by_one_are_assigned_one_at_a_time(tiny_model, tmp_path):
    trainer, _ = _trainer(tiny_model)
    groups = make_groups(B, N, seed=22, max_len=40)
    log: list = []
    trainer.on_event = lambda ev, f: log.append((ev, dict(f)))
    waiting = threading.Event()

    def on_wait(assigned: int) -> None:
        log.append(("wait", {"assigned": assigned}))
        waiting.set()

    def feed() -> None:  # another thread adds each group only once the core waits for it
        for group in groups:
            assert waiting.wait(60), "the core never waited"
            waiting.clear()
            log.append(("added", {"group_id": group[0]}))
            _add(trainer.buffer, group)

    feeder = threading.Thread(target=feed)
    feeder.start()
    core = _core(trainer, tmp_path)
    summed: list[torch.Tensor] = []
    try:
        report = core.step(on_wait=on_wait, on_summed_grads=summed.append, final=True)
    finally:
        feeder.join()
        core.coordinator.close()
    assert [f["assigned"] for ev, f in log if ev == "wait"] == [0, 1, 2, 3]
    pos = {
        (ev, f.get("group_id", f.get("assigned"))): i
        for i, (ev, f) in enumerate(log)
        if ev != "microstep_claim"
    }
    for k, (gid, _, _) in enumerate(groups):
        # the core waited with k groups, group k arrived, was assigned, then the core waited again (or finished)
        assert pos[("wait", k)] < pos[("added", gid)] < pos[("group_assigned", gid)]
        if k + 1 < B:
            assert pos[("group_assigned", gid)] < pos[("wait", k + 1)]
    claims = _check_claims(log)
    assert report.group_ids == [g[0] for g in groups]
    assert len([c for c in claims if c["kind"] == "train"]) == report.num_microsteps >= B
    # the streamed batch is the same batch: loss and gradient equal a trainer given all groups at once
    ref, _ = _trainer(tiny_model)
    for group in groups:
        _add(ref.buffer, group)
    ref.accumulate()
    ref_grads = ref.core.backend.flat_grads()
    ref_report = ref.finish()
    assert report.loss == pytest.approx(ref_report.loss, abs=1e-12, rel=1e-9)
    assert torch.allclose(summed[0], ref_grads, atol=1e-12, rtol=1e-9)
    assert float(ref_grads.abs().max()) > 1e-4


def test_a_starving_core_waits_until_aborted(tiny_model, tmp_path):
    trainer, _ = _trainer(tiny_model)
    _add(trainer.buffer, make_groups(1, N, seed=23, max_len=40)[0])
    waited, abort = threading.Event(), threading.Event()

    def aborter() -> None:
        assert waited.wait(60)
        abort.set()

    t = threading.Thread(target=aborter)
    t.start()
    core = _core(trainer, tmp_path)
    try:
        with pytest.raises(StepAborted, match="batch 0 aborted while the core waited for ready groups"):
            core.step(on_wait=lambda n: waited.set() if n == 1 else None, abort=abort)
    finally:
        t.join()
        core.coordinator.close()
    assert trainer.in_batch and len(trainer.packer.groups) == 1 and trainer.version == 0


def test_a_bounded_starve_timeout_still_raises_data_starvation(tiny_model, tmp_path):
    trainer, _ = _trainer(tiny_model)
    core = _core(trainer, tmp_path, starve_timeout_s=0.0)
    try:
        with pytest.raises(DataStarvation, match="batch 0"):
            core.step()
    finally:
        core.coordinator.close()


def test_a_claim_at_batch_open_never_closes_the_new_batch(tiny_model):
    """A satellite's claim that pumps between the queue's open and the packer's open saw the previous batch's packer
    closed and closed the new queue: the core's pump then failed with "the stream of this batch is closed" (about
    once in 90 batch openings of a normal run). The gate: the claim is made exactly there, inside the queue's open.
    Before the fix the pump lock is free at that point and the claim runs through at once (and closes the stream);
    now it waits for the lock until both streams are open."""
    trainer, _ = _trainer(tiny_model)
    for group in make_groups(2 * B, N, seed=5, max_len=24):
        _add(trainer.buffer, group)
    trainer.step()  # batch 0 ends: its packer is closed
    assert trainer.packer.closed
    seen: dict = {}
    claimant = threading.Thread(target=lambda: seen.update(item=trainer.claim(1)))
    queue_open = trainer.queue.open

    def open_then_claim(batch: int) -> None:
        queue_open(batch)
        seen["lock_held"] = trainer._pump_lock.locked()
        if seen["lock_held"]:
            claimant.start()  # it can only pump once open_batch lets go of the lock
        else:
            # nothing orders it after the packer's open: the interleaving that failed
            seen["item"] = trainer.claim(1)

    trainer.queue.open = open_then_claim
    trainer.open_batch()  # before the fix: RuntimeError, the stream of this batch is closed
    if seen["lock_held"]:
        claimant.join()
    assert seen["lock_held"]
    item = seen["item"]
    assert item is not None and item.microstep.batch == 1  # the claim got the new batch's first micro-step
    assert not trainer.queue.finished  # the claimed item is still out: the batch goes on
