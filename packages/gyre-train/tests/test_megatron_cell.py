"""Pipelined cells in a multi-cell run: K=2 cells of PP=2 (4 processes over gloo, ``gyre_train.megatron.cell``).

The core cell's leader claims through its trainer while the satellite cell's leader claims through the core's
coordinator, both from the one shared micro-step queue; each leader runs its items through its cell's continuous
1F1B (its stage-1 process follows the tokens). The satellite joins mid-batch (before its second item the core waits
until the satellite has claimed one: a gate, not a sleep; waiting for the join alone let a fast core claim all six
items while the satellite loaded the snapshot). Checked: the step's summed gradient and loss equal the single-process float64
replay of the dumped batch, both cells trained, each cell filled and drained its pipeline exactly once per batch
in which it trained, and every stage process counted the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest
import torch

from gyre_train.loss import LossConfig
from gyre_train.ports import free_ports
from gyre_train.replay import load_dump, replay_batch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU/gloo variant"),
]

K, PP, STEPS = 2, 2, 2

RANK = (
    textwrap.dedent(
        """
    import json, sys, torch, torch.distributed as dist
    from pathlib import Path
    from gyre_train.backends import build_backend
    from gyre_train.buffer import TrajectoryBuffer
    from gyre_train.loss import LossConfig
    from gyre_train.megatron.cell import (PipelinedBackend, PipelinedWorker, StageFollower, init_pipelined_cell,
                                         open_channel)
    from gyre_train.multicell import CoreRunner, MultiCellConfig
    from gyre_train.packing import PackingConfig
    from gyre_train.satellite import SatelliteRunner
    from gyre_train.testing.synthetic import make_groups
    from gyre_train.trainer import Trainer, TrainerConfig

    model_path, out, cell, stage, master, control = sys.argv[1:7]
    cell, stage, out = int(cell), int(stage), Path(out)
    torch.set_num_threads(1)
    mc = MultiCellConfig(num_cells=%(K)d, master_port=int(master), control_port=int(control),
                         snapshot_dir=str(out / "snapshots"), steps_per_burst=%(STEPS)d,
                         authkey="megatron-cell-test-" * 2)  # every rank: the same key
    groups = init_pipelined_cell(mc, cell, stage, %(PP)d)
    backend = build_backend("megatron", model_path=model_path, lr=1e-3, optimizer=cell == 0,
                            pipeline_parallel=%(PP)d)
    channel = open_channel("127.0.0.1")
    loss = LossConfig()
    stats = out / f"stats-{cell}-{stage}.jsonl"
    if stage > 0:
        StageFollower(backend, channel, loss, cell=cell, stats_path=stats).serve()
        sys.exit(0)
    whole = PipelinedBackend(backend, channel, loss, cell=cell, stats_path=stats)
    worker = PipelinedWorker(whole)
    if cell > 0:
        runner = SatelliteRunner(mc, worker, groups)
        runner.run()
        groups.barrier(runner.stop_members)
        whole.stop()
        sys.exit(0)
    buffer = TrajectoryBuffer(4)
    for gid, v, execs in make_groups(2 * %(STEPS)d, 4, seed=3, max_len=50):
        for eid, reward, trajs in execs:
            buffer.add_execution(gid, v, eid, reward, trajs)
    packing = PackingConfig(group_size=4, batch_groups=2, tokens_per_shard=64, window_shards=2)
    trainer = Trainer(TrainerConfig(packing=packing, loss=loss), worker, buffer)
    core = CoreRunner(mc, trainer, groups)
    with open(out / "reports.jsonl", "w") as f:
        for step in range(%(STEPS)d):
            def hold(n):
                if step == 0 and n == 1:
                    core.coordinator.wait_claimed(1, timeout=120)
            report = core.step(before_core_item=hold, dump_dir=str(out / f"dump-{step}"))
            f.write(report.model_dump_json() + "\\n")
    whole.save_hf_pretrained(out / "policy")
    core.stop()
    groups.barrier(core.coordinator.live_cells())
    core.coordinator.close()
    whole.stop()
    """
    )
    .replace("%(K)d", str(K))
    .replace("%(PP)d", str(PP))
    .replace("%(STEPS)d", str(STEPS))
)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for every rank; the first one that fails ends the others at once. A dead rank leaves its peers blocked
    in a rendezvous or a store read for their own timeouts, so waiting on the ranks in order hid the one that failed
    behind a peer's 400 s wait (a CI run: the satellite's wait timed out and the core's log was never shown)."""
    with ThreadPoolExecutor(len(procs)) as pool:
        pending = {pool.submit(p.wait) for p in procs}
        try:
            while pending:
                done, pending = wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)
                if not done or any(f.result() != 0 for f in done):
                    break
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipelined-cells")
    script = out / "rank.py"
    script.write_text(RANK)
    master, control = free_ports(2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for s in range(PP):
        for c in range(K):
            argv = [
                sys.executable,
                str(script),
                tiny_model,
                str(out),
                str(c),
                str(s),
                str(master),
                str(control),
            ]
            logs.append(out / f"rank-{c}-{s}.log")
            with logs[-1].open("w") as log:
                procs.append(subprocess.Popen(argv, env=env, start_new_session=True, stdout=log, stderr=log))
    _wait_all(procs, timeout_s=400)
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, f"{log.name} exited {p.returncode}:\n" + "\n".join(
            f"--- {other.name}\n{other.read_text()[-2500:]}" for other in logs
        )
    return out


def test_pipelined_core_and_satellite_share_the_queue_and_match_the_reference(run, tiny_model) -> None:
    reports = [json.loads(line) for line in (run / "reports.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in reports] == [1, 2]
    by_cell = {int(k): v for k, v in reports[0]["microsteps_by_cell"].items()}
    assert by_cell.get(0, 0) >= 1 and by_cell.get(1, 0) >= 1, by_cell  # both cells claimed from the one queue
    for step, report in enumerate(reports):
        dump = run / f"dump-{step}"
        loss, grads = replay_batch(dump, tiny_model, dtype="float64", loss=LossConfig(), temperature=1.0)
        summed = load_dump(dump).summed_grads
        assert loss == pytest.approx(report["loss"], abs=1e-6)
        assert float(summed.abs().max()) > 1e-4
        assert torch.allclose(grads, summed.double(), atol=1e-6, rtol=0)


def test_each_cell_fills_and_drains_once_per_batch_on_every_stage(run) -> None:
    reports = [json.loads(line) for line in (run / "reports.jsonl").read_text().splitlines()]
    for cell in range(K):
        rows = [
            [json.loads(x) for x in (run / f"stats-{cell}-{s}.jsonl").read_text().splitlines()]
            for s in range(PP)
        ]
        trained = sum(1 for r in reports if r["microsteps_by_cell"].get(str(cell), 0) > 0)
        assert len(rows[0]) == trained >= 1, (cell, rows[0])
        for stage_rows in rows:
            assert [(r["fills"], r["drains"]) for r in stage_rows] == [(1, 1)] * trained
        # every stage ran the same items; the two stages are distinct processes
        assert [r["microsteps"] for r in rows[0]] == [r["microsteps"] for r in rows[1]]
        assert rows[0][0]["pid"] != rows[1][0]["pid"]
    assert (run / "policy" / "model.safetensors").exists()
