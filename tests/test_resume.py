"""`gyre run --resume RUN`: a real run killed (SIGKILL of the controller's process group) after its second step,
with executions of the next dispatch in flight, then resumed from its last step checkpoint to six steps.

One kill and one resume serve every assertion: contiguous step versions, the final checkpoint, the optimizer state
carried over (Adam's step count), the interrupted part's records untouched, its trace kept and settled by one
`resume` line, its untrained groups with finished work carried over (a ready one trained at once, an open one
completed by executions dispatched into it first) and trained once (with the rewards gyre-eval stored), nothing
else of it trained, no group trained twice, counters recomputed from the trace equal to the scheduler's own.
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


def _ready_and_open_after_publish(trace: Path, version: int) -> bool:
    """Version `version` is published; a group is ready that no step trained; and a group of the dispatch after the
    publication is still open with an execution assessed (valid or no_work) while others run. So steps 1-2 are done
    and checkpointed, step 3 is not (it needs B = 2 ready groups: the old one and a new one, which needs all N of
    its executions), executions are in flight, and both kinds of carried group are there: one to train at once, one
    to complete."""
    if not trace.exists():
        return False
    published = False
    ready, trained, assessed_after = set(), set(), set()
    for raw in trace.read_bytes().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            return False  # a line being written
        published |= line["ev"] == "publish" and line["version"] == version
        if line["ev"] == "group_ready":
            ready.add(line["group"])
        elif line["ev"] == "step_end":
            trained.update(line["groups"])
        elif published and line["ev"] == "assessed" and line["status"] != "excluded":
            assessed_after.add(line["execution"].split(".")[0])
    return bool(ready - trained) and bool(assessed_after - ready)


def _usable_in_store(run_dir: Path) -> set[str]:
    """Executions with a designated valid or no_work assessment in gyre-eval's store and, for a valid one, the
    trajectories the proxy exported: what a resume may count."""
    rows = sqlite3.connect(run_dir / "assessments.sqlite").execute(
        "SELECT execution_id, status FROM assessments WHERE designated = 1 AND status IN ('valid', 'no_work')"
    )
    return {
        e
        for e, status in rows
        if status == "no_work" or (run_dir / "trajectories" / f"{e}.parquet").is_file()
    }


@pytest.mark.timeout(2400)  # three runs (292 s on an idle machine); the suite's 600 s is one run's budget
def test_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--run-dir",
        str(run_dir),
        "--steps",
        "4",
        "--set",
        "scheduler.B=2",
        "--set",
        "dashboard.enabled=false",
        "--quiet",
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    steps = run_dir / "metrics" / "steps.jsonl"
    deadline = time.monotonic() + 600
    try:
        while not _ready_and_open_after_publish(run_dir / "trace.jsonl", 2):  # the gate: see its docstring
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, (
                "no open group with an assessed execution after version 2 in 600 s"
            )
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert _versions(steps) == [1, 2]
    usable_at_kill = _usable_in_store(run_dir)
    records = {str(p.relative_to(run_dir)): p.read_bytes() for p in (run_dir / "records").rglob("*.jsonl")}
    assert records
    trace_before = (run_dir / "trace.jsonl").read_bytes()
    trace_before = trace_before[: trace_before.rfind(b"\n") + 1]

    # Resumed to 6 steps (only --steps may be raised): room for the carried open group to complete and be trained.
    resumed = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "run", "--resume", str(run_dir), "--steps", "6", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.splitlines()[-1])
    assert summary["steps"] == 4  # the resumed part's own steps: 3 to 6
    # the resolved config says so
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 6

    # Step versions contiguous over both parts; the final checkpoint and the last two step checkpoints.
    assert _versions(steps) == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "checkpoints" / "policy-v6" / "config.json").exists()
    kept = sorted(p.name for p in (run_dir / "checkpoints" / "trainer").glob("step-*"))
    assert kept == ["step-5", "step-6"]
    # The optimizer state went on from step 2: Adam has taken 5 steps at version 5 (a fresh one would say 3).
    state = torch.load(run_dir / "checkpoints" / "trainer" / "step-5" / "trainer.pt", weights_only=False)
    adam_steps = {float(s["step"]) for s in state["backend"]["optimizer"]["state"].values()}
    assert adam_steps == {5.0}

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
    # Group ids never reused (a carried open group's second dispatch line is marked carried); no group trained
    # twice; of the killed part's groups, exactly the carried ones trained after the resume.
    dispatched = [x["group"] for x in lines if x["ev"] == "dispatch" and not x.get("carried")]
    assert len(dispatched) == len(set(dispatched))
    trained = [g for x in lines if x["ev"] == "step_end" for g in x["groups"]]
    assert len(trained) == len(set(trained)) == 6 * 2
    old_groups = {x["group"] for x in before if x["ev"] == "dispatch"}
    trained_before = {g for x in before if x["ev"] == "step_end" for g in x["groups"]}
    ready_before = {x["group"] for x in before if x["ev"] == "group_ready"}
    # Every untrained group with an execution that finished and was assessed: as gyre-eval's store had it at the kill,
    # which may hold an assessment the trace never got (the controller died before its `assessed` line).
    assessed_before = {x["execution"]: x["status"] for x in before if x["ev"] == "assessed"}
    usable_before = {
        e.split(".")[0] for e in usable_at_kill if assessed_before.get(e) != "excluded" and e in ended
    }
    assert {e.split(".")[0] for e, status in assessed_before.items() if status != "excluded"} <= usable_before
    carried = set(resume["carried_groups"])
    assert carried == usable_before - trained_before
    carried_ready, carried_open = carried & ready_before, carried - ready_before
    assert carried_ready and carried_open  # the gate: both kinds
    assert set(resume["dropped_groups"]) == old_groups - trained_before - carried
    # A carried open group gets the executions it lacks, numbered after the old ones, launched before anything else.
    execs_of: dict[str, list[str]] = {}
    for x in lines:
        if x["ev"] == "dispatch":
            execs_of.setdefault(x["group"], []).extend(x["executions"])
    more = {x["group"]: x for x in after if x["ev"] == "dispatch" and x.get("carried")}
    assert set(more) == carried_open
    for gid, x in more.items():
        old = [e for y in before if y["ev"] == "dispatch" and y["group"] == gid for e in y["executions"]]
        indices = [int(e.split(".e")[1]) for e in x["executions"]]
        assert indices == list(range(len(old), len(old) + len(indices))) and x["v_d"] == 2
    first_launches = [x["execution"] for x in after if x["ev"] == "launch"][
        : sum(len(x["executions"]) for x in more.values())
    ]
    assert {e.split(".")[0] for e in first_launches} == carried_open
    trained_after = {g for x in after if x["ev"] == "step_end" for g in x["groups"]}
    dropped_after = {x["group"] for x in after if x["ev"] == "group_dropped"}
    assert old_groups & trained_after == carried - dropped_after  # every carried group trained, or dropped
    print(
        f"carried ready {sorted(carried_ready)}, open {sorted(carried_open)} (more: "
        f"{ {g: len(x['executions']) for g, x in more.items()} }), dropped after {sorted(dropped_after & carried)}"
    )
    # A carried group is trained at its own dispatch version (staleness = the step's version - 1 - v_d), and each
    # step's mean reward is the one gyre-eval's store gives its groups' counted members (the first N usable in
    # dispatch-index order; a carried open group's are old and new).
    v_d = {x["group"]: x["v_d"] for x in before if x["ev"] == "dispatch"}
    store = sqlite3.connect(run_dir / "assessments.sqlite")
    score = dict(
        store.execute(
            "SELECT execution_id, COALESCE(score, 0) FROM assessments WHERE designated = 1 "
            "AND status IN ('valid', 'no_work')"
        )
    )
    rows = {json.loads(x)["policy_version"]: json.loads(x) for x in steps.read_text().splitlines()}
    old_status = {e: status for members in resume["carried_members"].values() for e, status in members}

    def counts(g: str, e: str) -> bool:
        """Usable: scored, and for an old execution of a carried group usable when the run resumed (an assessment
        gyre-eval finished only after its restart came too late to count)."""
        return e in score and old_status.get(e, "valid") != "excluded"

    for x in after:
        if x["ev"] == "step_end":
            for g, st in zip(x["groups"], x["staleness"], strict=True):
                if g in carried:
                    assert st == x["version"] - 1 - v_d[g], (g, x)
            members = [e for g in x["groups"] for e in [e for e in execs_of[g] if counts(g, e)][:4]]
            assert len(members) == 4 * len(x["groups"])
            assert rows[x["version"]]["mean_reward"] == pytest.approx(
                sum(score[e] for e in members) / len(members)
            )
    # Counters recomputed from the whole trace equal the scheduler's (both parts).
    summary_trace = read_trace(run_dir / "trace.jsonl")
    sched = json.loads((run_dir / "metrics" / "scheduler.json").read_text())
    assert (summary_trace.d, summary_trace.p, summary_trace.f, summary_trace.x) == (
        sched["d"],
        sched["p"],
        sched["f"],
        sched["x"],
    )
    assert summary_trace.steps == sched["version"] == 6

    # Compared with an uninterrupted run of the same seed and config.
    whole = tmp_path / "whole"
    argv_whole = [a if a != str(run_dir) else str(whole) for a in argv]
    done = subprocess.run(argv_whole, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _versions(whole / "metrics" / "steps.jsonl") == [1, 2, 3, 4]  # the same optimizer steps (4 of 6)
    steps_of = {
        r: [json.loads(x)["num_groups"] for x in (r / "metrics" / "steps.jsonl").read_text().splitlines()]
        for r in (run_dir, whole)
    }
    assert steps_of[run_dir] == [2] * 6 and steps_of[whole] == [2] * 4
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
    after_ids = {x["execution"] for x in after if x["ev"] == "launch" and x["group"] not in carried}
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
    again = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "run", "--resume", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"gyre run: cannot resume: {run_dir.resolve()} already finished its 6 steps (checkpoint at step 6)"
    ]
