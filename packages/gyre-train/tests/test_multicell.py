"""Two cell processes over gloo: a satellite joins mid-batch; the summed gradient equals the float64 reference."""

from __future__ import annotations

import json

import pytest
import torch

from gyre_eval.groups import group_advantages
from gyre_train.localrun import LocalRunSpec, launch
from gyre_train.loss import LossConfig
from gyre_train.replay import load_dump, replay_batch
from gyre_train.testing.loss_reference import RefExecution, reference_loss, trajectory_target_logprobs
from gyre_train.testing.synthetic import make_groups


def _reference_grads(model_path: str, spec: LocalRunSpec) -> tuple[float, torch.Tensor]:
    from transformers import AutoModelForCausalLM  # slow to import: not at collection

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    model.eval()
    execs = []
    for _, _, ex in make_groups(spec.batch_groups, spec.group_size, spec.seed, spec.max_len):
        for (_, _, trajs), a in zip(ex, group_advantages([r for _, r, _ in ex]), strict=True):
            lps = [trajectory_target_logprobs(model, t, 1.0) for t in trajs]
            bs = [
                torch.tensor(
                    [b for b, m in zip(t.behavior_logprobs, t.target_mask, strict=True) if m],
                    dtype=torch.float64,
                )
                for t in trajs
            ]
            execs.append(RefExecution(a, torch.cat(lps), torch.cat(bs)))
    loss = reference_loss(execs, spec.group_size * spec.batch_groups, LossConfig())
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.slow
def test_two_cell_processes_satellite_joins_mid_batch(tiny_model, tmp_path):
    spec = LocalRunSpec(
        model_path=tiny_model,
        out_dir=str(tmp_path),
        num_cells=2,
        steps=2,
        steps_per_burst=2,
        wait_join_at=2,
        save_grads=True,
        dump_steps=(0, 1),
    )
    assert launch(spec, timeout=240) == [0, 0]
    reports = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in reports] == [1, 2]
    first = reports[0]
    by_cell = {int(k): v for k, v in first["microsteps_by_cell"].items()}
    assert by_cell.get(1, 0) >= 1 and by_cell[0] >= 1  # both cells trained in step 0
    # step 1 ran after a non-final update (parameters broadcast to the satellite, which stayed)
    assert (tmp_path / "grads-1.pt").exists() and reports[1]["num_target_tokens"] > 0
    ref_loss, ref_grads = _reference_grads(tiny_model, spec)
    assert first["loss"] == pytest.approx(ref_loss, abs=1e-9)
    grads = torch.load(tmp_path / "grads-0.pt")
    assert torch.allclose(grads, ref_grads, atol=1e-6, rtol=0)
    assert float(ref_grads.abs().max()) > 1e-4
    # the dumped batches, recomputed on one in-process cell from their params_before (single-cell reference)
    for step, report in enumerate(reports):
        dump = load_dump(tmp_path / f"dump-{step}")
        assert len(dump.microsteps) == report["num_microsteps"] and dump.report.loss == report["loss"]
        assert torch.equal(dump.summed_grads, torch.load(tmp_path / f"grads-{step}.pt"))
        loss, grads = replay_batch(
            tmp_path / f"dump-{step}", tiny_model, dtype="float64", loss=LossConfig(), temperature=1.0
        )
        assert loss == pytest.approx(report["loss"], abs=1e-6)
        assert torch.allclose(grads, dump.summed_grads, atol=1e-6, rtol=0)
        if step == 0:  # and the replay itself equals the literal float64 reference
            assert loss == pytest.approx(ref_loss, abs=1e-9)
            assert torch.allclose(grads, ref_grads, atol=1e-9, rtol=0)


def _coordinator(tiny_model, tmp_path, batch_groups: int):
    """A core's coordinator (K = 3) in front of a trainer holding `batch_groups` groups of 2 (no processes)."""
    from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
    from gyre_train.buffer import TrajectoryBuffer
    from gyre_train.cell import CellWorker
    from gyre_train.multicell import Coordinator, MultiCellConfig
    from gyre_train.packing import PackingConfig
    from gyre_train.ports import free_port
    from gyre_train.trainer import Trainer, TrainerConfig

    buffer = TrajectoryBuffer(2)
    for gid, v, execs in make_groups(batch_groups, 2, seed=1, max_len=30):
        for eid, r, trajs in execs:
            buffer.add_execution(gid, v, eid, r, trajs)
    trainer = Trainer(
        TrainerConfig(packing=PackingConfig(group_size=2, batch_groups=batch_groups, tokens_per_shard=32)),
        CellWorker(0, TorchBackend(TorchBackendConfig(model_path=tiny_model)), LossConfig()),
        buffer,
    )
    cfg = MultiCellConfig(num_cells=3, master_port=1, control_port=free_port(), snapshot_dir=str(tmp_path))
    return Coordinator(cfg, trainer), trainer


def test_coordinator_keeps_the_training_set_a_prefix_and_closes_the_window(tiny_model, tmp_path):
    from gyre_train.types import CellRequest

    coord, trainer = _coordinator(tiny_model, tmp_path, batch_groups=1)
    try:
        assert coord.handle(CellRequest(op="join", cell=1)).status == "wait"  # no batch open
        coord.open_batch(0, str(tmp_path / "snap.pt"))
        trainer.open_batch()
        assert coord.handle(CellRequest(op="join", cell=2)).status == "wait"  # cell 1 must join first
        joined = coord.handle(CellRequest(op="join", cell=1))
        assert joined.status == "joined" and joined.snapshot.endswith("snap.pt") and joined.batch == 0
        assert coord.handle(CellRequest(op="join", cell=2)).status == "joined"
        item = coord.handle(CellRequest(op="claim", cell=2))
        assert item.status == "item" and item.item.microstep.batch == 0
        assert coord.close_window(broadcast=True) == [0, 1, 2]  # prefix of three cells
        assert coord.handle(CellRequest(op="join", cell=2)).status == "wait"  # window closed: next batch
        done = coord.handle(CellRequest(op="claim", cell=1))
        assert (done.status, done.prefix, done.broadcast) == ("batch_done", 3, True)
        assert coord.handle(CellRequest(op="claim", cell=1)).status == "wait"  # acknowledged once
        with pytest.raises(ValueError, match="does not exist"):
            coord.handle(CellRequest(op="claim", cell=3))
        coord.open_batch(1, str(tmp_path / "snap.pt"))
        assert coord.participants == {0, 1, 2}  # broadcast receivers stay for the next batch
    finally:
        coord.close()


def test_strangers_on_the_control_port_leave_the_coordinator_serving(tiny_model, tmp_path):
    """A plain connect-and-close, a peer with the wrong key and one sending garbage before any handshake: each is
    refused on its own connection, and a satellite with the key is served after them (the listener's own handshake
    ran in the accept thread, which one connect-and-close ended for good)."""
    import socket
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    import orjson

    from gyre_train.types import CellRequest, CoordinatorReply

    coord, _ = _coordinator(tiny_model, tmp_path, batch_groups=1)
    address = (coord.cfg.host, coord.cfg.control_port)
    try:
        socket.create_connection(address).close()
        with socket.create_connection(address) as raw:
            raw.sendall(b"\x00\x00\x00\x10GET / HTTP/1.1\r\n\r\n")
        with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
            Client(address, authkey=b"not-the-key")
        with Client(address, authkey=coord.cfg.authkey.encode()) as conn:
            conn.send_bytes(CellRequest(op="join", cell=1).model_dump_json().encode())
            reply = CoordinatorReply.model_validate(orjson.loads(conn.recv_bytes()))
        assert reply.status == "wait" and reply.error is None  # served: no batch is open yet
    finally:
        coord.close()


def test_a_wait_for_a_claim_ends_when_the_cell_dies(tiny_model, tmp_path):
    """`wait_claimed` (the core's hold for a joining satellite) returns once the cell claimed, and ends at once
    when the cell dies before it claims: a hold no longer waits out its timeout for a cell that is gone."""
    import threading

    from gyre_train.types import CellRequest

    coord, trainer = _coordinator(tiny_model, tmp_path, batch_groups=2)
    try:
        coord.open_batch(0, str(tmp_path / "snap.pt"))
        trainer.open_batch()
        for cell in (1, 2):
            assert coord.handle(CellRequest(op="join", cell=cell)).status == "joined"
        assert coord.handle(CellRequest(op="claim", cell=1)).status == "item"
        coord.wait_claimed(1, timeout=60)  # claimed: returns at once
        errors: list[BaseException] = []

        def hold() -> None:
            try:
                coord.wait_claimed(2, timeout=600)
            except TimeoutError as exc:
                errors.append(exc)

        waiter = threading.Thread(target=hold, daemon=True)
        waiter.start()
        coord.lose(2, "killed", dead=True)
        # not 600: the death ends the wait, whether it came before the wait began or during it
        waiter.join(60)
        assert not waiter.is_alive() and "died before it claimed" in str(errors[0])
    finally:
        coord.close()


@pytest.mark.slow
def test_satellite_killed_holding_a_claim_the_batch_completes_with_the_reference_gradient(
    tiny_model, tmp_path
):
    spec = LocalRunSpec(
        model_path=tiny_model,
        out_dir=str(tmp_path),
        num_cells=2,
        steps=1,
        wait_join_at=2,
        save_grads=True,
        kill_at_item=2,
    )
    assert launch(spec, timeout=240) == [
        0,
        -9,
    ]  # the satellite died by SIGKILL on its 2nd item; the core finished
    (report,) = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    by_cell = {int(k): v for k, v in report["microsteps_by_cell"].items()}
    assert by_cell == {0: report["num_microsteps"]}  # nothing of the dead cell is counted
    ref_loss, ref_grads = _reference_grads(tiny_model, spec)
    assert report["loss"] == pytest.approx(ref_loss, abs=1e-9)
    grads = torch.load(tmp_path / "grads-0.pt")
    assert torch.allclose(grads, ref_grads, atol=1e-6, rtol=0)
    assert float(ref_grads.abs().max()) > 1e-4


@pytest.mark.slow
def test_middle_satellite_killed_survivors_reduce_over_a_fresh_group(tiny_model, tmp_path):
    # cells 0, 1, 2 train; cell 1 dies: the members {0, 2} are no prefix, so they reduce over a fresh gloo group
    spec = LocalRunSpec(
        model_path=tiny_model,
        out_dir=str(tmp_path),
        num_cells=3,
        steps=1,
        wait_join_at=1,
        save_grads=True,
        kill_at_item=2,
    )
    assert launch(spec, timeout=240) == [0, -9, 0]
    (report,) = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    by_cell = {int(k): v for k, v in report["microsteps_by_cell"].items()}
    assert 1 not in by_cell and by_cell.get(2, 0) >= 1 and sum(by_cell.values()) == report["num_microsteps"]
    ref_loss, ref_grads = _reference_grads(tiny_model, spec)
    assert report["loss"] == pytest.approx(ref_loss, abs=1e-9)
    grads = torch.load(tmp_path / "grads-0.pt")
    assert torch.allclose(grads, ref_grads, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_satellite_that_dies_or_hangs_inside_the_reduce_leaves_the_core_to_update_alone(
    tiny_model, tmp_path, fault
):
    # cells 0, 1, 2 train step 0; cell 1 is killed (its connection closes) or stopped (it answers nothing) right
    # before its reduce: the collective fails (at once, or after the 5 s collective timeout), the core runs every
    # satellite item again and updates alone, with the exact gradient; cell 2 is out of training until a re-form
    spec = LocalRunSpec(
        model_path=tiny_model,
        out_dir=str(tmp_path),
        num_cells=3,
        steps=2,
        wait_join_at=1,
        save_grads=True,
        collective_fault=fault,
        collective_timeout_s=5.0,
    )
    assert launch(spec, timeout=240) == [0, -9, 0]
    first, second = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert first["collective_failed"] == [1, 2]
    assert {int(k): v for k, v in first["microsteps_by_cell"].items()} == {0: first["num_microsteps"]}
    ref_loss, ref_grads = _reference_grads(tiny_model, spec)
    assert first["loss"] == pytest.approx(ref_loss, abs=1e-9)
    grads = torch.load(tmp_path / "grads-0.pt")
    assert torch.allclose(grads, ref_grads, atol=1e-6, rtol=0)
    # the next step trains on the core alone: the broken world is not used again
    assert second["policy_version"] == 2 and second["collective_failed"] == []
    assert {int(k): v for k, v in second["microsteps_by_cell"].items()} == {0: second["num_microsteps"]}
    bursts = json.loads((tmp_path / "satellite-2.json").read_text())["bursts"]
    assert bursts[0] in ("collective_failed", "burst_end") and len(bursts) == 1


@pytest.mark.slow
def test_a_satellite_that_dies_before_the_broadcast_leaves_the_update_whole_and_the_next_step_to_the_core(
    tiny_model, tmp_path
):
    # step 0 is not final (mu = 2): cells 0, 1, 2 reduce, the core updates, then cell 1 dies before the broadcast.
    # The update used every cell's gradient (the reduce succeeded); the broadcast fails, so the satellites that
    # stayed have no weights: they are out until a re-form, and step 1 trains on the core alone
    spec = LocalRunSpec(
        model_path=tiny_model,
        out_dir=str(tmp_path),
        num_cells=3,
        steps=2,
        steps_per_burst=2,
        wait_join_at=1,
        save_grads=True,
        collective_fault="kill",
        collective_fault_at="broadcast",
        collective_timeout_s=5.0,
    )
    assert launch(spec, timeout=240) == [0, -9, 0]
    first, second = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert first["collective_failed"] == [1, 2]
    by_cell = {int(k): v for k, v in first["microsteps_by_cell"].items()}
    # the satellites' work counted
    assert by_cell.get(2, 0) >= 1 and sum(by_cell.values()) == first["num_microsteps"]
    ref_loss, ref_grads = _reference_grads(tiny_model, spec)
    assert first["loss"] == pytest.approx(ref_loss, abs=1e-9)
    assert torch.allclose(torch.load(tmp_path / "grads-0.pt"), ref_grads, atol=1e-6, rtol=0)
    assert second["policy_version"] == 2 and second["collective_failed"] == []
    assert {int(k): v for k, v in second["microsteps_by_cell"].items()} == {0: second["num_microsteps"]}
    # cell 2's side of the broadcast may have completed before cell 1 died: then it waits, joined, until the stop
    assert json.loads((tmp_path / "satellite-2.json").read_text())["bursts"] in ([], ["collective_failed"])
