"""A satellite cell's worker killed (SIGKILL) while it trains: the K=3 run goes on with the other cells and completes.

The gate: the trace's first micro-step claim by cell 1 (the core holds its batch until cell 1 has joined once). Then
the cell-1 worker process is killed. Asserted from the run directory: all steps done, the loss traced
(`cell_lost`), every micro-step cell 1 claimed in that batch claimed again by a live cell (requeued), cell 1 in no
later claim, transition or route, later batches reduced without it (cell 2 may still join: the prefix skips the dead
cell), and counters recomputed from the trace equal to the scheduler's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_sched.trace import iter_trace, read_trace

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _trace(run_dir: Path) -> list[dict]:
    path = run_dir / "trace.jsonl"
    if not path.exists():
        return []
    out = []
    for raw in path.read_bytes().splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            break  # a line being written
    return out


def _worker_pid(run_dir: Path, cell: int) -> int:
    """The `gyre-cell worker --config RUN/cells/cell-<cell>.json` process."""
    needle = str(run_dir / "cells" / f"cell-{cell}.json").encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no worker process for cell {cell}")


def test_killed_satellite_worker_the_run_completes_without_it(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "gyre.cli", "run", str(ROOT / "configs" / "elastic-k3.toml"), "--run-dir",
            str(run_dir), "--set", "train.hold_core_for_join=1", "--set", "dashboard.enabled=false", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    try:
        while not any(x["ev"] == "microstep_claim" and x["cell"] == 1 for x in _trace(run_dir)):  # the gate
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "cell 1 never claimed a micro-step"
            time.sleep(0.05)
        os.kill(_worker_pid(run_dir, 1), signal.SIGKILL)
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = json.loads(out.decode().splitlines()[-1])
    assert summary["steps"] == 4

    lines = list(iter_trace(run_dir / "trace.jsonl"))
    (lost,) = [x for x in lines if x["ev"] == "cell_lost"]
    assert lost["cell"] == 1
    at = lines.index(lost)
    before, after = lines[:at], lines[at + 1 :]
    # Cell 1 is in nothing after its loss.
    assert not [x for x in after if x.get("cell") == 1 and x["ev"] in ("microstep_claim", "transition_begin")]
    assert not [x for x in after if x["ev"] in ("launch", "route") and x["engine"] == "cell:1"]
    # Its claims of the batch it died in were requeued: each (batch, index) claimed again by a live cell.
    claims = [x for x in before if x["ev"] == "microstep_claim" and x["cell"] == 1]
    died_in = max(x["batch"] for x in claims)
    mine = {x["index"] for x in claims if x["batch"] == died_in}
    again = {x["index"] for x in lines[lines.index(claims[-1]) + 1 :]
             if x["ev"] == "microstep_claim" and x["batch"] == died_in and x["cell"] != 1}  # fmt: skip
    assert mine <= again, (mine, again)
    # Every step done, with B groups each; steps after the loss summed no micro-step of cell 1.
    rows = [json.loads(x) for x in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["num_groups"] == 2 for r in rows)
    assert all(r["microsteps_by_cell"].get("1", 0) == 0 for r in rows if r["step"] > died_in)
    # The trace still recomputes the scheduler's counters; the final weights are saved.
    trace = read_trace(run_dir / "trace.jsonl")
    state = json.loads((run_dir / "metrics" / "scheduler.json").read_text())
    assert (trace.d, trace.p, trace.f, trace.x) == (state["d"], state["p"], state["f"], state["x"])
    assert trace.steps == state["version"] == 4
    assert trace.roles[1][-1][2] == "lost"
    assert (run_dir / "checkpoints" / "policy-v4" / "config.json").exists()
