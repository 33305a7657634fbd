"""Run K cells as local processes on synthetic data (tests and benchmarks of multi-cell training on CPU).

``launch(spec)`` starts one process per cell (spawn), each joining gloo as its cell index; the core trains
``spec.steps`` steps on synthetic groups (``gyre_train.testing.synthetic.make_groups``) and writes ``reports.jsonl`` (one
StepReport per line) and, if asked, the summed gradient of each step (``grads-<step>.pt``) and batch dumps for
``gyre_train.replay`` (``dump-<step>/``) to ``spec.out_dir``.

Scenarios (``spec.scenario``):

- ``"run"``: every satellite runs ``SatelliteRunner.run()`` (bursts back to back until stop).
- ``"leave_rejoin"`` (K=2, 2 steps): cell 1 joins step 0 mid-batch (before the core's item ``wait_join_at``); step 0
  is not final, so it stays after the broadcast; then it is told to leave and returns ``"left"`` from its first
  ``run_burst``; the core opens step 1 (final) without it, and cell 1 joins again mid-batch (second ``run_burst``,
  which returns ``"burst_end"``); a third ``run_burst`` returns ``"stop"``. Cell 1 writes ``satellite-1.json``
  (``bursts``: the three results, ``items``: items run per burst).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.loss import LossConfig
from gyre_train.multicell import CoreRunner, MultiCellConfig, init_cell_process
from gyre_train.packing import PackingConfig
from gyre_train.ports import free_ports
from gyre_train.satellite import SatelliteRunner
from gyre_train.testing.synthetic import make_groups
from gyre_train.trainer import Trainer, TrainerConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalRunSpec:
    """A local multi-cell run on synthetic groups."""

    model_path: str
    """Local HF checkpoint."""
    out_dir: str
    """Where reports (and gradients) are written."""
    num_cells: int = 2
    """K."""
    steps: int = 1
    """Optimizer steps to run."""
    group_size: int = 4
    """N."""
    batch_groups: int = 3
    """B."""
    tokens_per_shard: int = 64
    """Shard capacity."""
    max_len: int = 60
    """Longest synthetic trajectory."""
    seed: int = 0
    """Seed of the synthetic groups."""
    dtype: str = "float64"
    """Parameter dtype."""
    lr: float = 1e-6
    """Adam learning rate."""
    steps_per_burst: int = 1
    """mu."""
    wait_join_at: int | None = None
    """If set, the core waits for the last cell to join and claim before its item number ``wait_join_at`` (step 0),
    and the other satellites hold their first item until that claim."""
    save_grads: bool = False
    """Write each step's summed gradient."""
    threads: int = 1
    """torch intra-op threads per cell process."""
    kill_at_item: int | None = None
    """If set, cell 1 SIGKILLs itself on receiving its n-th item, before running it (lost-satellite tests); with
    ``wait_join_at``, the core holds (step 0) until cell 1 is gone."""
    claim_timeout_s: float = 300.0
    """Claim lease of the coordinator."""
    collective_fault: Literal["kill", "stop"] | None = None
    """If set, cell 1 SIGKILLs or SIGSTOPs itself right before its end-of-batch ``collective_fault_at`` of step 0
    (a member that dies or hangs inside the collective); a stopped cell is killed once the core has finished."""
    collective_fault_at: Literal["reduce", "broadcast"] = "reduce"
    """Which collective (the broadcast follows a non-final step: ``steps_per_burst`` > 1)."""
    collective_timeout_s: float | None = None
    """Timeout of the collectives between cells (``MultiCellConfig.collective_timeout_s``)."""
    dump_steps: tuple[int, ...] = ()
    """Steps the core dumps to ``out_dir/dump-<step>`` (``gyre_train.replay``)."""
    scenario: Literal["run", "leave_rejoin"] = "run"
    """What the satellites do (module docstring)."""

    def __post_init__(self) -> None:
        if self.scenario == "leave_rejoin" and (
            (self.num_cells, self.steps) != (2, 2) or self.wait_join_at is None
        ):
            raise ValueError("the leave_rejoin scenario runs 2 cells for 2 steps and needs wait_join_at")


_SIGNAL_S = 120.0  # how long a scenario waits for the other process before failing


def _wait(event, what: str) -> None:
    if not event.wait(_SIGNAL_S):
        raise TimeoutError(f"{what} did not happen within {_SIGNAL_S} s")


def _leave_rejoin_satellite(runner: SatelliteRunner, events: dict, out: Path) -> None:
    leave = threading.Event()

    def leave_after_step0() -> None:
        if events["step0_done"].wait(_SIGNAL_S):
            leave.set()

    threading.Thread(target=leave_after_step0, daemon=True).start()
    bursts, items = [], []
    before = runner.items_run
    bursts.append(runner.run_burst(leave))  # joins step 0 mid-batch, stays after the broadcast, then leaves
    items.append(runner.items_run - before)
    events["left"].set()
    _wait(events["rejoin"], "the core's call to rejoin")
    leave.clear()
    before = runner.items_run
    bursts.append(runner.run_burst(leave))  # joins step 1 mid-batch; step 1 ends the burst
    items.append(runner.items_run - before)
    bursts.append(runner.run_burst(leave))  # the core has stopped
    (out / f"satellite-{runner.worker.cell}.json").write_text(json.dumps({"bursts": bursts, "items": items}))


def _cell_main(spec: LocalRunSpec, mc: MultiCellConfig, cell: int, events: dict | None = None) -> None:
    torch.set_num_threads(spec.threads)
    groups = init_cell_process(mc, cell)
    loss = LossConfig()
    backend = TorchBackend(
        TorchBackendConfig(model_path=spec.model_path, dtype=spec.dtype, lr=spec.lr, optimizer=cell == 0)
    )
    worker = CellWorker(cell, backend, loss)
    if cell > 0:
        received = 0

        # With ``wait_join_at``, the core waits for the last cell's first claim: the other satellites hold their
        # first item until then, or a fast cell 1 can claim every item while the last cell still loads (a CI run
        # under load: cell 2 claimed nothing in 120 s and the scenario failed).
        hold_first = spec.wait_join_at is not None and 0 < cell < spec.num_cells - 1

        def on_item(item, cell: int = cell) -> None:
            nonlocal received
            received += 1
            if hold_first and received == 1:
                _wait(events["last_claimed"], f"cell {spec.num_cells - 1}'s first claim")
            if cell == 1 and received == spec.kill_at_item:
                os.kill(os.getpid(), signal.SIGKILL)  # dies holding a claim

        runner = SatelliteRunner(mc, worker, groups, on_item=on_item)
        if cell == 1 and spec.collective_fault is not None:
            fault = signal.SIGKILL if spec.collective_fault == "kill" else signal.SIGSTOP

            def before(kind: str, batch: int | None) -> None:
                if (kind, batch) == (spec.collective_fault_at, 0):
                    os.kill(os.getpid(), fault)

            runner.before_collective = before
        if spec.scenario == "leave_rejoin":
            _leave_rejoin_satellite(runner, events, Path(spec.out_dir))
        else:
            bursts = []
            while (result := runner.run_burst(threading.Event())) != "stop":
                bursts.append(result)
            (Path(spec.out_dir) / f"satellite-{cell}.json").write_text(json.dumps({"bursts": bursts}))
        if cell not in runner.stop_members:  # its world with the core broke: no barrier, no clean teardown
            os._exit(0)
        groups.barrier(runner.stop_members)  # the live cells leave together
        torch.distributed.destroy_process_group()
        return
    buffer = TrajectoryBuffer(spec.group_size)
    for gid, v, execs in make_groups(
        spec.steps * spec.batch_groups, spec.group_size, spec.seed, spec.max_len
    ):
        for eid, reward, trajs in execs:
            buffer.add_execution(gid, v, eid, reward, trajs)
    packing = PackingConfig(
        group_size=spec.group_size,
        batch_groups=spec.batch_groups,
        tokens_per_shard=spec.tokens_per_shard,
        window_shards=2,
    )
    trainer = Trainer(TrainerConfig(packing=packing, loss=loss), worker, buffer)
    core = CoreRunner(mc, trainer, groups)
    out = Path(spec.out_dir)
    rejoin = spec.scenario == "leave_rejoin"
    with open(out / "reports.jsonl", "w") as f:
        for step in range(spec.steps):

            def hook(n: int, step: int = step) -> None:
                if spec.wait_join_at is None or n != spec.wait_join_at:
                    return
                if step == 0:
                    core.coordinator.wait_claimed(spec.num_cells - 1, timeout=_SIGNAL_S)
                    events["last_claimed"].set()
                    # the core takes no item meanwhile: cell 1 gets its n-th
                    if spec.kill_at_item is not None:
                        core.coordinator.wait_dead(1, timeout=_SIGNAL_S)
                elif rejoin and step == 1:
                    events["rejoin"].set()
                    core.coordinator.wait_claimed(1, timeout=_SIGNAL_S)

            def save(g: torch.Tensor, step: int = step) -> None:
                if spec.save_grads:
                    torch.save(g, out / f"grads-{step}.pt")

            if rejoin and step == 1:
                _wait(events["left"], "cell 1 leaving")
            final = (step == 1) if rejoin else None
            dump = str(out / f"dump-{step}") if step in spec.dump_steps else None
            report = core.step(before_core_item=hook, on_summed_grads=save, final=final, dump_dir=dump)
            f.write(report.model_dump_json() + "\n")
            f.flush()
            if rejoin and step == 0:
                events["step0_done"].set()
    core.stop()
    # satellites have seen `stop`: the live cells leave together
    groups.barrier(core.coordinator.live_cells())
    core.coordinator.close()
    if core.coordinator.unformed:  # a broken world's gloo threads can abort interpreter teardown
        os._exit(0)
    torch.distributed.destroy_process_group()


def launch(spec: LocalRunSpec, timeout: float = 300.0) -> list[int]:
    """Run all cells to completion; returns the exit codes (cell order)."""
    Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
    master_port, control_port = free_ports(2)
    mc = MultiCellConfig(
        num_cells=spec.num_cells,
        master_port=master_port,
        control_port=control_port,
        snapshot_dir=str(Path(spec.out_dir) / "snapshots"),
        steps_per_burst=spec.steps_per_burst,
        claim_timeout_s=spec.claim_timeout_s,
        collective_timeout_s=spec.collective_timeout_s,
    )
    ctx = mp.get_context("spawn")
    events = {name: ctx.Event() for name in ("step0_done", "left", "rejoin", "last_claimed")}
    procs = [
        ctx.Process(target=_cell_main, args=(spec, mc, c, events), name=f"cell-{c}")
        for c in range(spec.num_cells)
    ]
    for p in procs:
        p.start()
    procs[0].join(timeout)
    for cell, p in enumerate(procs[1:], start=1):
        if cell == 1 and spec.collective_fault == "stop" and not procs[0].is_alive():
            continue  # stopped for good: killed below
        p.join(timeout)
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    return codes
