"""`gyre run --resume RUN`: a real run killed (SIGKILL of the controller's process group) after its second step,
with executions of the next dispatch in flight, then resumed from its last step checkpoint to the configured four steps.

One kill and one resume serve every assertion: contiguous step versions, the final checkpoint, the optimizer state
carried over (Adam's step count), the interrupted part's records untouched, its trace kept and settled by one
`resume` line, no group trained twice or taken over from the killed part, counters recomputed from the trace equal
to the scheduler's own.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gyre.tasks import demo_queries
from gyre_sched.trace import iter_trace, read_trace

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _versions(steps: Path) -> list[int]:
    if not steps.exists():
        return []
    return [json.loads(line)["policy_version"] for line in steps.read_text().splitlines() if line.strip()]


def _running_after_publish(trace: Path, version: int) -> bool:
    """Version `version` is published and an execution of the next dispatch has been launched: steps 1-2 are done
    and checkpointed, step 3 cannot be (its groups are still rolling out), and executions are in flight."""
    if not trace.exists():
        return False
    published = False
    for raw in trace.read_bytes().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            return False  # a line being written
        published |= line["ev"] == "publish" and line["version"] == version
        if published and line["ev"] == "launch":
            return True
    return False


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "gyre.cli", "demo", "--run-dir", str(run_dir), "--steps", "4",
            "--set", "scheduler.B=2", "--set", "dashboard.enabled=false", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    steps = run_dir / "metrics" / "steps.jsonl"
    deadline = time.monotonic() + 600
    try:
        while not _running_after_publish(run_dir / "trace.jsonl", 2):  # the gate, see _running_after_publish
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "no execution launched after publishing version 2 in 600 s"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert _versions(steps) == [1, 2]
    records = {str(p.relative_to(run_dir)): p.read_bytes() for p in (run_dir / "records").rglob("*.jsonl")}
    assert records
    trace_before = (run_dir / "trace.jsonl").read_bytes()
    trace_before = trace_before[: trace_before.rfind(b"\n") + 1]

    resumed = subprocess.run([sys.executable, "-m", "gyre.cli", "run", "--resume", str(run_dir), "--quiet"],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.splitlines()[-1])
    assert summary["steps"] == 2  # the resumed part's own steps: 3 and 4

    # Step versions contiguous over both parts; the final checkpoint and the last two step checkpoints.
    assert _versions(steps) == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "policy-v4" / "config.json").exists()
    kept = sorted(p.name for p in (run_dir / "checkpoints" / "trainer").glob("step-*"))
    assert kept == ["step-3", "step-4"]
    # The optimizer state went on from step 2: Adam has taken 3 steps at version 3 (a fresh one would say 1).
    state = torch.load(run_dir / "checkpoints" / "trainer" / "step-3" / "trainer.pt", weights_only=False)
    adam_steps = {float(s["step"]) for s in state["backend"]["optimizer"]["state"].values()}
    assert adam_steps == {3.0}

    # The interrupted part's call records are untouched: each execution's log byte for byte (new execution ids
    # after the resume), the store's shared registry only appended to.
    for name, data in records.items():
        now = (run_dir / name).read_bytes()
        assert now == data if name.endswith(".tito.jsonl") else now.startswith(data), name
    assert sum(name.endswith(".tito.jsonl") for name in records) >= 8

    # The trace: the interrupted part kept byte for byte, one header, one resume line settling its unfinished work.
    assert (run_dir / "trace.jsonl").read_bytes().startswith(trace_before)
    lines = list(iter_trace(run_dir / "trace.jsonl"))
    assert [x["ev"] for x in lines].count("header") == 1
    (resume,) = [x for x in lines if x["ev"] == "resume"]
    assert resume["version"] == 2
    before = lines[: lines.index(resume)]
    launched = {x["execution"] for x in before if x["ev"] == "launch"}
    ended = {x["execution"] for x in before if x["ev"] == "terminate"}
    assert set(resume["cancelled"]) == launched - ended and resume["cancelled"]  # executions were in flight
    after = lines[lines.index(resume) + 1 :]
    assert [x["t"] for x in after] == sorted(x["t"] for x in after) and after[0]["t"] >= resume["t"]
    # Group ids never reused; no group trained twice; nothing of the killed part trained after the resume.
    dispatched = [x["group"] for x in lines if x["ev"] == "dispatch"]
    assert len(dispatched) == len(set(dispatched))
    trained = [g for x in lines if x["ev"] == "step_end" for g in x["groups"]]
    assert len(trained) == len(set(trained)) == 4 * 2
    old_groups = {x["group"] for x in before if x["ev"] == "dispatch"}
    assert not old_groups & {g for x in after if x["ev"] == "step_end" for g in x["groups"]}
    assert set(resume["dropped_groups"]) == old_groups - {
        g for x in before if x["ev"] == "step_end" for g in x["groups"]
    }
    # Counters recomputed from the whole trace equal the scheduler's (both parts).
    summary_trace = read_trace(run_dir / "trace.jsonl")
    sched = json.loads((run_dir / "metrics" / "scheduler.json").read_text())
    assert (summary_trace.d, summary_trace.p, summary_trace.f, summary_trace.x) == (
        sched["d"], sched["p"], sched["f"], sched["x"])  # fmt: skip
    assert summary_trace.steps == sched["version"] == 4

    # Compared with an uninterrupted run of the same seed and config.
    whole = tmp_path / "whole"
    argv_whole = [a if a != str(run_dir) else str(whole) for a in argv]
    done = subprocess.run(argv_whole, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _versions(whole / "metrics" / "steps.jsonl") == [1, 2, 3, 4]  # the same optimizer steps
    steps_of = {r: [json.loads(x)["num_groups"] for x in (r / "metrics" / "steps.jsonl").read_text().splitlines()]
                for r in (run_dir, whole)}  # fmt: skip
    assert steps_of[run_dir] == steps_of[whole] == [2] * 4
    whole_trace = read_trace(whole / "trace.jsonl")
    whole_sched = json.loads((whole / "metrics" / "scheduler.json").read_text())
    for t, sch in ((summary_trace, sched), (whole_trace, whole_sched)):
        assert (t.d, t.p, t.f, t.x) == (sch["d"], sch["p"], sch["f"], sch["x"])
        assert 0 <= t.f <= t.p <= t.d - t.x
    # The data goes on where the interrupted part was: in both runs group g<n> works on the dataset's query n
    # (each execution's task is its designated evaluator), so the resumed part does not start the data again.
    queries = [f"task-{q.query_id}" for q in demo_queries(0)]
    for r in (run_dir, whole):
        evaluators = (
            sqlite3.connect(r / "assessments.sqlite")
            .execute("SELECT execution_id, evaluator FROM assessments WHERE designated = 1")
            .fetchall()
        )
        assert evaluators
        assert all(ev == queries[int(e.split(".")[0][1:]) % len(queries)] for e, ev in evaluators), evaluators
    after_ids = {x["execution"] for x in after if x["ev"] == "launch"}
    assert min(int(e.split(".")[0][1:]) for e in after_ids) >= resume["next_group"] > 0
    # No assessment repeated with a different result (the resumed part re-scores nothing of the killed part).
    scores = (
        sqlite3.connect(run_dir / "assessments.sqlite")
        .execute(
            "SELECT execution_id, COUNT(DISTINCT score) FROM assessments WHERE status = 'valid' GROUP BY execution_id"
        )
        .fetchall()
    )
    assert scores and all(n == 1 for _, n in scores)

    # A finished run cannot be resumed again: one line, exit status 2.
    again = subprocess.run([sys.executable, "-m", "gyre.cli", "run", "--resume", str(run_dir)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"gyre run: cannot resume: {run_dir.resolve()} already finished its 4 steps (checkpoint at step 4)"
    ]
