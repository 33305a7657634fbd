"""A harness timeout inside a real `gyre run` (docs/design/assessments.md): the runner's outcome reaches gyre-eval in the runner's own
vocabulary and the execution's preserved workspace is assessed. gyre-eval once had its own list of outcomes, without
`harness_timeout`: the first harness timeout of a run was a 422 that ended it (no run had ever reached one).

The gate is the timeout itself: 1 ms, which no harness process can finish within, so every execution the run launches
ends at its harness timeout before it makes a model call (no clock decides which)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from gyre_sched.trace import iter_trace

pytestmark = pytest.mark.slow


def test_every_execution_ends_at_its_harness_timeout_and_is_assessed(tmp_path):
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
        "agent.harness_timeout_s=0.001",
        "--set",
        "dashboard.enabled=false",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["mean_reward_per_step"] == [0.0]

    outcomes = {
        x["execution"]: x["outcome"] for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] == "terminate"
    }
    timed_out = {e for e, o in outcomes.items() if o == "harness_timeout"}
    assert outcomes and set(outcomes.values()) <= {
        "harness_timeout",
        "cancelled",
    }  # cancelled: at the run's end
    con = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = con.execute(
        "SELECT execution_id, status, score, submission, provenance FROM assessments WHERE designated = 1"
    ).fetchall()
    con.close()
    final = [r for r in rows if r[1] != "unresolved"]  # unresolved: still being assessed when the run ended
    assert len(final) >= 4  # at least the step's B groups of N
    for execution_id, status, score, submission, provenance in final:
        assert execution_id in timed_out
        assert json.loads(submission)["outcome"] == json.loads(provenance)["outcome"] == "harness_timeout"
        # the preserved (untouched) workspace was assessed: no answer.txt is a valid zero, never a placeholder
        assert (status, score) == ("valid", 0.0)
        assert json.loads(submission)["artifact_ref"].endswith(f"workspaces/{execution_id}")
