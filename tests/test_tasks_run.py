"""`gyre run` on a task file: 2 tasks of the SWE suite, each execution in the launch sandbox, workspaces built from
the task file, scored by each task's own executable check; records, assessments and trajectories are written for
every execution (each call sampled at the run's temperature), and `gyre-tito export` joins the rewards."""

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gyre.datasets import load_tasks
from gyre_sched.trace import iter_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gyre_run_on_the_swe_suite_in_the_sandbox(tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--steps",
        "1",
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--set",
        f"tasks.file={ROOT / 'tasks' / 'swe' / 'tasks.jsonl'}",
        "--set",
        "tasks.limit=2",
        "--set",
        "harness.sandbox=true",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "model.temperature=0.8",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1

    con = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = con.execute(
        "SELECT execution_id, evaluator, status, score FROM assessments WHERE designated = 1"
    ).fetchall()
    con.close()
    # Executions still running when the last step ends are cancelled at shutdown (a workspace, no assessment): check the
    # assessed ones, which include the step's B groups of N.
    launched = {p.name for p in (run_dir / "workspaces").iterdir() if not p.name.endswith(".home")}
    workspaces = sorted(r[0] for r in rows)
    assert set(workspaces) <= launched and len(workspaces) >= 4
    # the built-in agent reads but does not edit: each workspace scores what its starting repo scores
    start = {"task-swe-fizzbuzz": 0.5, "task-swe-slugify": 0.25}
    assert {(ev, status, score) for _, ev, status, score in rows} <= {
        (k, "valid", v) for k, v in start.items()
    }
    assert {ev for _, ev, _, _ in rows} == set(start)  # both tasks ran
    # Group n works on task n mod 2, and the trace names that task (q<item>): it recurs each epoch, so the
    # scheduler's predicted launch order can learn its durations.
    dispatches = [x for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] == "dispatch"]
    assert len(dispatches) > 2 and all(x["query"] == f"q{int(x['group'][1:]) % 2}" for x in dispatches)
    order = [f"task-{t.query_id}" for t in load_tasks(ROOT / "tasks" / "swe" / "tasks.jsonl")[:2]]
    assert all(ev == order[int(eid.split(".")[0][1:]) % 2] for eid, ev, _, _ in rows)
    for eid in workspaces:
        ws = run_dir / "workspaces" / eid
        assert (ws / "tests").is_dir() and any(ws.glob("*.py"))  # built from the task's repository
        log = run_dir / "records" / "records" / f"{eid}.tito.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()]  # plain JSON lines
        assert records and all(r["execution_id"] == eid for r in records)
        # the proxy pins every call to the run's temperature (the trainer's)
        assert {r["metadata"]["sampling"]["used"]["temperature"] for r in records} == {0.8}
        assert pq.read_table(run_dir / "trajectories" / f"{eid}.parquet").num_rows >= 1

    out = tmp_path / "export.parquet"
    r = subprocess.run(
        [sys.executable, "-m", "gyre_tito.cli", "export", str(run_dir), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    table = pq.read_table(out).to_pylist()
    rewards = {(t["execution_id"], t["reward"]) for t in table}
    assert set(workspaces) <= {e for e, _ in rewards}
    by_eval = {eid: start[ev] for eid, ev, _, _ in rows}
    assert all(reward == by_eval[eid] for eid, reward in rewards if eid in by_eval)
