"""The paper's tails inside one real `gyre run` (docs/design/assessments.md), each asserted in the trace, the
assessments, the group accounting and the trained batch.

Every group has N = 3 counted members and one spare (k_spare = 1), and its executions play the tails by their index
(`tests/tails_harness.py`), so every group a step trains holds all of them, whichever groups the step takes:
- e0: its evaluator fails on every attempt until the overall budget runs out: excluded (no score, never a zero),
  never trained, and the spare e3 completes the group in its place;
- e1: a model call the engines never answer (a stall: the run's engines play a script that holds it), so the
  harness's own timeout ends it and its process tree; the preserved answer is assessed and the reward trained,
  and nothing waits on the call that never came back;
- e2: cannot start its agent (a wrapper's exec of a program that is not installed): the zero-reward placeholder,
  distinct from a valid zero, trained as a placeholder;
- e1 and e3: the evaluator fails their first attempt, the retry within the budget makes them valid, both attempts
  kept.
No clock decides which execution meets which tail: e1 never ends by itself and e0 is never scored, so only when they
end depends on the machine's speed.
"""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_eval.groups import group_advantages
from gyre_sched.trace import iter_trace

ROOT = Path(__file__).resolve().parents[1]
HARNESS_TIMEOUT_S = 10.0
BUDGET_S = 20.0
STALL = "STALL-HERE"
"""In a prompt: the run's scripted engines never answer it (the script's `hold`)."""


def _attempts(con: sqlite3.Connection) -> dict[str, list[tuple[int, str | None]]]:
    found: dict[str, list[tuple[int, str | None]]] = {}
    for eid, ok, error in con.execute(
        "SELECT a.execution_id, t.ok, t.error FROM attempts t JOIN assessments a "
        "ON a.id = t.assessment_id ORDER BY t.assessment_id, t.number"
    ):
        found.setdefault(eid, []).append((ok, error))
    return found


@pytest.mark.slow
def test_every_tail_in_one_run(tmp_path):
    run_dir = tmp_path / "run"
    task = {
        "query_id": "tails",
        "prompt": "Name the code word.",
        "workspace": {"empty": True},
        "scoring": {"kind": "python", "factory": "tails_evaluators:TailsEvaluator"},
        "harness": {
            "kind": "command",
            "command": [
                sys.executable,
                "-I",
                str(ROOT / "tests" / "tails_harness.py"),
                "--task",
                "{task}",
                "--stall",
                STALL,
            ],
        },
        "harness_timeout_s": HARNESS_TIMEOUT_S,
        "overall_budget_s": BUDGET_S,
    }
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text(json.dumps(task) + "\n")
    # the policy's own log-probs for "OK."; a prompt with STALL never answered
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default_reply": "OK.", "hold": [STALL]}))
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
        f"tasks.file={task_file}",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "scheduler.N=3",
        "--set",
        "scheduler.B=2",
        "--set",
        "scheduler.k_spare=1",
        "--set",
        "debug.dump_batches=[0]",
        "--set",
        f"rollout.scripted_replies={script}",
    ]
    env = os.environ | {"PYTHONPATH": str(ROOT / "tests")}  # gyre-eval imports tails_evaluators
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1

    trace = list(iter_trace(run_dir / "trace.jsonl"))
    outcome = {x["execution"]: x["outcome"] for x in trace if x["ev"] == "terminate"}
    assessed = {x["execution"]: x["status"] for x in trace if x["ev"] == "assessed"}
    con = sqlite3.connect(run_dir / "assessments.sqlite")
    con.row_factory = sqlite3.Row
    rows = {r["execution_id"]: dict(r) for r in con.execute("SELECT * FROM assessments WHERE designated = 1")}
    attempts = _attempts(con)
    con.close()

    step = json.loads((run_dir / "metrics" / "steps.jsonl").read_text().splitlines()[0])
    dump = run_dir / "metrics" / "batches" / "batch-0" / "microsteps.jsonl"
    infos = {e["execution_id"]: e for line in dump.open() for e in json.loads(line)["executions"]}
    trained_groups = step["group_ids"]
    assert len(trained_groups) == 2
    print({e: (outcome.get(e), r["status"], r["score"], len(attempts.get(e, []))) for e, r in rows.items()})

    for gid in trained_groups:
        e0, e1, e2, e3 = (f"{gid}.e{k}" for k in range(4))
        # e0: excluded when its budget ran out, every attempt failed, never a zero, never trained
        assert outcome[e0] == "completed" and assessed[e0] == "excluded"
        assert (rows[e0]["status"], rows[e0]["score"], rows[e0]["final"]) == ("unresolved", None, 1)
        assert len(attempts[e0]) >= 2 and not any(ok for ok, _ in attempts[e0])
        assert all("cannot be scored" in err for _, err in attempts[e0])
        assert "budget expired" in json.loads(rows[e0]["provenance"])["last_error"]
        assert e0 not in infos
        # e1: its call never came back; the harness timeout ended it and its child; its preserved answer was
        # assessed and counts in the group (no call was recorded: it has no tokens to train)
        assert outcome[e1] == "harness_timeout" and assessed[e1] == "valid"
        assert json.loads(rows[e1]["submission"])["outcome"] == "harness_timeout"
        assert not (run_dir / "records" / "records" / f"{e1}.tito.jsonl").read_text().strip()
        assert e1 not in infos
        child = int((run_dir / "workspaces" / e1 / "child.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)  # the process tree went with the harness
        # e2: the placeholder, not a valid zero of its untouched workspace; no evaluator was asked
        assert outcome[e2] == "failed" and assessed[e2] == "no_work"
        assert (rows[e2]["status"], rows[e2]["score"]) == ("no_work", 0.0)
        assert "could not start" in json.loads(rows[e2]["provenance"])["details"]["no_work_reason"]
        assert e2 not in attempts and e2 not in infos  # a placeholder has no tokens to train
        # e1 and e3: unresolved after the first attempt, valid after the retry, both attempts kept
        for eid in (e1, e3):
            assert (rows[eid]["status"], rows[eid]["score"]) == ("valid", 1.0)
            assert [ok for ok, _ in attempts[eid]] == [0, 1]
            assert "briefly unavailable" in attempts[eid][0][1]
        assert outcome[e3] == "completed"
        # The group's counted members are e1, e2, e3 (the spare took the excluded e0's place), in that order.
        expected = group_advantages([1.0, 0.0, 1.0], "grpo")
        # e3's call was answered: its tokens train, with the group's advantage
        assert infos[e3]["group_id"] == gid
        assert infos[e3]["advantage"] == pytest.approx(expected[2], abs=1e-6)
    assert step["mean_reward"] == pytest.approx(2.0 / 3.0, abs=1e-9)
    # No group was dropped: the spare completed each one.
    assert not [x for x in trace if x["ev"] == "group_dropped"]
    # Every launched execution terminated (those running at the run's end as cancelled), and every assessment the
    # controller traced is final in gyre-eval's store with the same status (one that ends as the run stops may be
    # settled in the store with no trace line, or not yet submitted: the run's end is not a gate).
    launched = {x["execution"] for x in trace if x["ev"] == "launch"}
    assert launched == set(outcome)
    store_status = {"valid": "valid", "no_work": "no_work", "unresolved": "excluded"}
    for eid, status in assessed.items():
        assert rows[eid]["final"] == 1 and store_status[rows[eid]["status"]] == status, eid
