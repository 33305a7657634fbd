"""A satellite cell's worker killed (SIGKILL) while it trains: the K=3 run goes on, restarts it, and completes.

The gate: the trace's first micro-step claim by cell 1 (the core holds its batch until cell 1 has joined once). Then
the cell-1 worker process is killed. Asserted from the run directory: all steps done, the loss traced
(`cell_lost`), every micro-step cell 1 claimed in that batch claimed again by a live cell (requeued), cell 1 in no
claim, transition or route while lost; then the launcher's restart (`cell_restored`, once: the budget is one) with
the engine serving the version published last, executions launched on it afterwards whose tokens it served at that
version or later (their trajectories' weight-version spans); at the next burst boundary the gloo world re-formed
(`cell_restored` with `trains`), after which cell 1 claims micro-steps of a later batch again, whose loss and summed
gradient equal the single-process float64 replay of the dumped batch; counters recomputed from the trace equal to
the scheduler's own. The hold gate (`debug.hold_core_for_join=1`) keeps the next batch closed while cell 1 restarts
(a cold Python + torch start can outlast a short run's last burst) and holds the core again once it rejoined.

What the policy decides in each fault is tested in the simulator (packages/gyre-sched/tests/test_faults_sim.py: every
scenario here and more, deterministic, in seconds). The real processes here keep what only processes show: a SIGKILL
found by the event stream's end and the worker restarted and re-formed with a step equal to the replay (torch, and
megatron's regroup), Async's satellites re-forming from training, a SIGSTOPped host found by its silence, and a
satellite hung in the reduce recomputed by the core. A cell lost for good (the world's members) and a member hung in
the re-form (the bounded rendezvous) are covered there and by gyre-train's test_world_generation.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from gyre_sched.trace import iter_trace, read_trace
from gyre_train.loss import LossConfig
from gyre_train.replay import replay_batch

pytestmark = pytest.mark.slow

STEPS = 4


def _spans(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [s for row in pq.read_table(path).to_pylist() for s in row["weight_versions"]]


def _cell1_claimed(lines: list[dict]) -> bool:
    return any(x["ev"] == "microstep_claim" and x["cell"] == 1 for x in lines)


def _kill_cell1_at_its_first_claim(fault_run, tmp_path: Path, run_dir: Path, *sets: str) -> dict:
    """SIGKILL cell 1's worker at its first traced claim (the gate)."""

    def kill() -> None:
        os.kill(fault_run.worker_pid(run_dir, 1), signal.SIGKILL)

    return fault_run(tmp_path, run_dir, _cell1_claimed, kill, *sets)


def _requeued(lines: list[dict], lost: dict) -> int:
    """Every micro-step cell 1 claimed in the batch it died in was claimed again by a live cell; returns that batch."""
    claims = [x for x in lines[: lines.index(lost)] if x["ev"] == "microstep_claim" and x["cell"] == 1]
    died_in = max(x["batch"] for x in claims)
    mine = {x["index"] for x in claims if x["batch"] == died_in}
    again = {
        x["index"]
        for x in lines[lines.index(claims[-1]) + 1 :]
        if x["ev"] == "microstep_claim" and x["batch"] == died_in and x["cell"] != 1
    }
    assert mine <= again, (mine, again)
    return died_in


def _restart_story(tmp_path: Path, run_dir: Path) -> str:
    """What a failed restore assertion prints: the controller's warnings about cells, the key trace events with their
    times, and the last lines of cell 1's logs (a restart that failed says why there)."""
    log = (tmp_path / "controller.log").read_text(errors="replace").splitlines()
    keys = ("cell_lost", "cell_restored", "step_end", "publish", "batch_open", "collective_failed")
    events = [f"{x['t']:.1f} {x['ev']}" for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] in keys]
    tails = []
    for path in sorted((run_dir / "logs").glob("cell-1*.log")):
        tails += [f"{path.name}: {ln[:300]}" for ln in path.read_text(errors="replace").splitlines()[-6:]]
    return "\n".join([*(ln[:400] for ln in log if "cell" in ln), *events, *tails])


def _counters_recompute(run_dir: Path):
    """The trace alone recomputes the scheduler's counters (d, p, f, x) as the run ended with them; returns it."""
    trace = read_trace(run_dir / "trace.jsonl")
    state = json.loads((run_dir / "metrics" / "scheduler.json").read_text())
    assert (trace.d, trace.p, trace.f, trace.x) == (state["d"], state["p"], state["f"], state["x"])
    return trace


def _equals_replay(run_dir: Path, batch: int, row: dict, backend: str = "torch") -> None:
    """The step of `batch` (its dump) equals the single-process reference: loss and summed gradient (float64 for
    the torch backend; a one-process megatron backend in float32, the dump's layout, for megatron)."""
    dump = run_dir / "metrics" / "batches" / f"batch-{batch}"
    dtype, atol = ("float64", 1e-6) if backend == "torch" else ("float32", 1e-5)
    loss, grads = replay_batch(
        dump, str(run_dir / "model"), dtype=dtype, loss=LossConfig(), temperature=1.0, backend=backend
    )
    assert loss == pytest.approx(row["loss"], abs=atol)
    summed = torch.load(dump / "summed_grads.pt").to(grads.dtype)
    assert torch.allclose(grads, summed, atol=atol, rtol=0), float((grads - summed).abs().max())


# The megatron cells (one process, float32) re-create megatron's groups in the re-formed world.
BACKENDS = {
    "torch": ("train.dtype=float64",),
    "megatron": ("train.backend=megatron", "train.dtype=float32", "train.lr_warmup_steps=0"),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_killed_satellite_worker_is_restarted_and_the_run_completes(fault_run, tmp_path, backend):
    run_dir = tmp_path / "run"
    summary = _kill_cell1_at_its_first_claim(
        fault_run,
        tmp_path,
        run_dir,
        f"train.steps={STEPS}",
        *BACKENDS[backend],
        f"debug.dump_batches={list(range(STEPS))}",
    )
    assert summary["steps"] == STEPS

    lines = list(iter_trace(run_dir / "trace.jsonl"))
    (lost,) = [x for x in lines if x["ev"] == "cell_lost"]
    assert lost["cell"] == 1
    at = lines.index(lost)
    # Restarted once, serving the version published last before it took work again.
    (restored,) = [x for x in lines if x["ev"] == "cell_restored" and not x["trains"]]
    back = lines.index(restored)
    assert restored["cell"] == 1 and back > at and restored["trains"] is False
    published = [x["version"] for x in lines[:back] if x["ev"] == "publish"]
    assert restored["serves"] == (published[-1] if published else 0)
    # Cell 1 is in nothing while lost.
    while_lost = lines[at + 1 : back]
    assert not [
        x for x in while_lost if x.get("cell") == 1 and x["ev"] in ("microstep_claim", "transition_begin")
    ]
    assert not [x for x in while_lost if x["ev"] in ("launch", "route") and x["engine"] == "cell:1"]
    # Rollout work on the restarted engine: what it generated was at the restored version or a later one.
    on_it = [x["execution"] for x in lines[back:] if x["ev"] == "launch" and x["engine"] == "cell:1"]
    assert on_it, "the restarted cell took no rollout work"
    url = json.loads((run_dir / "services.json").read_text())["cells"][1]
    served = [
        s
        for e in on_it
        if (run_dir / "trajectories" / f"{e}.parquet").exists()
        for s in _spans(run_dir / "trajectories" / f"{e}.parquet")
        if s["engine_id"] == url
    ]
    assert served and all(int(s["weight_version"]) >= restored["serves"] for s in served), served
    print(
        f"restored at t={restored['t']:.1f} s (lost at {lost['t']:.1f} s), serving v{restored['serves']}; "
        f"{len(on_it)} executions launched on it, {len(served)} spans served by it"
    )
    # Its claims of the batch it died in were requeued: each (batch, index) claimed again by a live cell.
    died_in = _requeued(lines, lost)
    # Every step done, with B groups each; steps after the loss summed no micro-step of cell 1.
    rows = [json.loads(x) for x in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["num_groups"] == 2 for r in rows)
    # Training rejoin: a new world generation at a burst boundary, then claims by cell 1 in a later batch.
    (rejoined,) = [x for x in lines if x["ev"] == "cell_restored" and x["trains"]]
    assert rejoined["cell"] == 1 and lines.index(rejoined) > back
    later = sorted(
        {
            x["batch"]
            for x in lines[lines.index(rejoined) :]
            if x["ev"] == "microstep_claim" and x["cell"] == 1
        }
    )
    assert later and min(later) > died_in, "the restarted cell claimed no micro-step after rejoining"
    assert [r["step"] for r in rows if r["step"] > died_in and r["microsteps_by_cell"].get("1", 0)] == later
    # That step (cells 0 and 1, maybe 2) equals the single-process reference on the same batch.
    batch = later[0]
    _equals_replay(run_dir, batch, rows[batch], backend)
    print(
        f"rejoined at t={rejoined['t']:.1f} s; cell 1 claimed in batches {later}; "
        f"batch {batch} by cell {rows[batch]['microsteps_by_cell']}, loss {rows[batch]['loss']:.6f} = replay"
    )
    # The trace still recomputes the scheduler's counters; the final weights are saved.
    trace = _counters_recompute(run_dir)
    assert trace.steps == json.loads((run_dir / "metrics" / "scheduler.json").read_text())["version"] == STEPS
    assert [r for _, _, r in trace.roles[1]][-1] != "lost"
    assert (run_dir / "checkpoints" / f"policy-v{STEPS}" / "config.json").exists()


def test_async_training_satellite_lost_restarts_idle_and_trains_again(fault_run, tmp_path):
    """Async, K=3, cells 0 and 1 train (the fixed split), cell 2 rolls out. Cell 1's worker is SIGKILLed after its
    first claim: its claims are requeued, it is restarted and takes no rollout work while it waits, the training
    world re-forms at the publication (the core and cell 1 re-form from training), cell 1 switches back to training
    and claims micro-steps of a later batch, whose step equals the single-process float64 reference."""
    steps, run_dir = 4, tmp_path / "run"
    summary = _kill_cell1_at_its_first_claim(
        fault_run,
        tmp_path,
        run_dir,
        "scheduler.kind=async",
        "scheduler.async_train_cells=2",
        f"train.steps={steps}",
        "train.dtype=float64",
        f"debug.dump_batches={list(range(steps))}",
    )
    assert summary["steps"] == steps

    lines = list(iter_trace(run_dir / "trace.jsonl"))
    (lost,) = [x for x in lines if x["ev"] == "cell_lost"]
    (restored,) = [x for x in lines if x["ev"] == "cell_restored" and not x["trains"]]
    (rejoined,) = [x for x in lines if x["ev"] == "cell_restored" and x["trains"]]
    assert lost["cell"] == restored["cell"] == rejoined["cell"] == 1
    assert lines.index(lost) < lines.index(restored) < lines.index(rejoined)
    # The split holds: cell 1 never rolls out (no launch or route to its engine), and it switches back to training
    # only after its training side rejoined.
    assert not [x for x in lines if x["ev"] in ("launch", "route") and x.get("engine") == "cell:1"]
    back = [x for x in lines[lines.index(rejoined) :] if x["ev"] == "transition_begin" and x["cell"] == 1]
    assert back and back[0]["to"] == "to_training", back
    # Its claims of the batch it died in were claimed again; after the rejoin it claims in a later batch.
    died_in = _requeued(lines, lost)
    later = sorted(
        {
            x["batch"]
            for x in lines[lines.index(rejoined) :]
            if x["ev"] == "microstep_claim" and x["cell"] == 1
        }
    )
    assert later and min(later) > died_in, "cell 1 claimed no micro-step after rejoining"
    rows = [json.loads(x) for x in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    _equals_replay(run_dir, later[0], rows[later[0]])
    trace = _counters_recompute(run_dir)
    assert [r for _, _, r in trace.roles[1]][-1] == "training"


def test_a_satellite_that_stops_answering_is_lost_restarted_and_trains_again(fault_run, tmp_path):
    """A host that loses power or its network sends nothing: no reset, no end of file, calls just hang. SIGSTOP plays
    it on one machine (a SIGKILLed process's kernel still closes its sockets). Cell 1's worker is stopped at the first
    publication (a burst boundary: no batch is open and it is back in rollout, so it hangs in no collective); the
    controller's event stream from it times out, it is taken as lost (the executions it held move to free slots, or
    are cancelled when there is none), the launcher kills and restarts it, and it trains again after the next
    boundary's re-form. The run completes every step. (Stopping cell 2 instead once hung the run: its executions
    were cancelled and their groups never settled; `packages/gyre-sched/tests/test_cell_lost.py` pins that fix, as
    here free slots decide whether anything is cancelled.)"""
    steps = 8  # four bursts: the restart ends before the last boundary, the re-form there
    run_dir = tmp_path / "run"
    stopped: list[tuple[int, float]] = []

    def stop_cell1() -> None:
        pid = fault_run.worker_pid(run_dir, 1)
        os.kill(pid, signal.SIGSTOP)
        stopped.append((pid, fault_run.trace(run_dir)[-1]["t"]))

    def boundary(lines: list[dict]) -> bool:
        return any(x["ev"] == "publish" for x in lines)

    # The stream's silence bound is this test's to set: 15 s, not the 50 s default it waited out before.
    summary = fault_run(
        tmp_path, run_dir, boundary, stop_cell1, f"train.steps={steps}", "launcher.cell_silence_s=15"
    )
    assert summary["steps"] == steps
    ((pid, t_stop),) = stopped
    assert not Path(f"/proc/{pid}").exists()  # the launcher killed the stopped worker before restarting
    err = (tmp_path / "controller.log").read_text()

    lines = list(iter_trace(run_dir / "trace.jsonl"))
    (lost,) = [x for x in lines if x["ev"] == "cell_lost"]
    assert lost["cell"] == 1 and lost["t"] > t_stop
    assert "cell 1 lost (RunFailed: cell 1 stopped answering (ReadTimeout)" in err
    restored = [(x["cell"], x["trains"]) for x in lines if x["ev"] == "cell_restored"]
    assert restored == [(1, False), (1, True)], (restored, _restart_story(tmp_path, run_dir))
    rejoined = next(i for i, x in enumerate(lines) if x["ev"] == "cell_restored" and x["trains"])
    assert [x for x in lines[rejoined:] if x["ev"] == "microstep_claim" and x["cell"] == 1], (
        "cell 1 claimed no micro-step after rejoining"
    )
    # Every launched execution ended, or was cut off by the run's end (its run_end line: those the last step's
    # boundary dispatched); the groups of cancelled executions settled (ready with a spare, or dropped).
    launched = {x["execution"] for x in lines if x["ev"] == "launch"}
    ended = {x["execution"] for x in lines if x["ev"] == "terminate"}
    assert launched - ended == set(lines[-1]["cancelled"]), (sorted(launched - ended), lines[-1])
    cancelled = {x["execution"] for x in lines if x["ev"] == "terminate" and x["outcome"] == "cancelled"}
    settled = {x["group"] for x in lines if x["ev"] in ("group_ready", "group_dropped")}
    trained = {g for x in lines if x["ev"] == "step_end" for g in x["groups"]}
    assert {e.split(".")[0] for e in cancelled} <= settled and trained <= settled
    assert len(trained) == 2 * steps  # B = 2 groups a step
    _counters_recompute(run_dir)
    print(
        f"stopped at t={t_stop:.1f} s, lost at {lost['t']:.1f} s, rejoined at {lines[rejoined]['t']:.1f} s; "
        f"{len(cancelled)} executions cancelled"
    )


def test_a_satellite_that_hangs_inside_the_reduce_is_recomputed_by_the_core_and_the_satellites_train_again(
    fault_run, tmp_path
):
    """A host that stops answering inside the end-of-batch reduce: the `stop_gate` test gate SIGSTOPs cell 1 right
    before its first one (batch 0 as a rule: the core holds for cell 1's claim, but only `hold_timeout_s`, so a
    loaded machine can move it to a later batch; cell 2 joins that batch or not, as the policy's timing goes). The core's reduce fails after the collective timeout (10 s here), the core runs every satellite
    micro-step of that batch again and updates alone (trace: `collective_failed`), a live cell 2 of that batch is out
    of training until the world is re-formed, cell 1 is lost when its event stream times out and is restarted, and at
    a later boundary they take their training rank again in a re-formed world. Before, the core waited out gloo's 30
    minutes and then the run failed."""
    steps = 6  # three bursts: cell 1 is restarted before the second boundary, where the world is re-formed
    run_dir = tmp_path / "run"
    # Cell 1 is lost once its event stream has been silent for `cell_silence_s`: 15 s here, not the 50 s default
    # the run waited out between the failed reduce and the loss (trace: collective_failed at 15.9 s, cell_lost 60.1 s).
    summary = fault_run(
        tmp_path,
        run_dir,
        lambda lines: True,
        lambda: None,
        f"train.steps={steps}",
        'debug.stop_gate={"cell": 1, "at": "reduce"}',
        "train.collective_timeout_s=10",
        "launcher.cell_silence_s=15",
        "debug.hold_timeout_s=120",
    )
    assert summary["steps"] == steps
    lines = list(iter_trace(run_dir / "trace.jsonl"))
    (failed,) = [x for x in lines if x["ev"] == "collective_failed"]
    cells = failed["cells"]
    assert cells in ([1], [1, 2]), failed
    at = lines.index(failed)
    # it failed at cell 1's first reduce: cell 1 trained in that batch and in none before it (CI's loaded run once
    # held batch 0 past its hold and cell 1 first trained in batch 1)
    batches_of_cell_1 = {x["batch"] for x in lines[:at] if x["ev"] == "microstep_claim" and x["cell"] == 1}
    assert min(batches_of_cell_1) == failed["version"], (batches_of_cell_1, failed)
    # the failed batch's step counts the core's micro-steps only: it ran the satellites' again
    (report,) = [
        json.loads(r)
        for r in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()
        if json.loads(r)["step"] == failed["version"]
    ]
    assert report["collective_failed"] == cells
    assert set(report["microsteps_by_cell"]) == {"0"} and report["num_microsteps"] >= 2
    (lost,) = [x for x in lines if x["ev"] == "cell_lost"]
    assert lost["cell"] == 1 and lost["t"] > failed["t"]
    restored = [(x["cell"], x["trains"]) for x in lines[at:] if x["ev"] == "cell_restored"]
    assert (1, False) in restored and (1, True) in restored, restored
    if 2 in cells:  # alive, but its world with the core broke: rollout-only until the re-form, then trainable
        assert (2, True) in restored, restored
        assert any(x["ev"] == "cell_untrained" and x["cell"] == 2 for x in lines[at:])
    # the restarted cell 1 claims micro-steps again in the re-formed world
    rejoined = max(i for i, x in enumerate(lines) if x["ev"] == "cell_restored" and x["trains"])
    claims = {x["cell"] for x in lines[rejoined:] if x["ev"] == "microstep_claim"}
    assert 1 in claims, f"after the re-form only cells {claims} claimed micro-steps"
    _counters_recompute(run_dir)
    print(
        f"collective with cells {cells} failed at t={failed['t']:.1f} s, cell 1 lost at {lost['t']:.1f} s, "
        f"re-formed at {lines[rejoined]['t']:.1f} s"
    )
