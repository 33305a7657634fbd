"""`gyre run` on judge-rubric tasks, end to end: the run's `[judge]` section points gyre-eval's judge at a scripted
OpenAI-compatible endpoint on loopback (`gyre_eval.testing.ScriptedJudge`: no capable judge model runs on a CPU).

The judge scores what it is shown: the share of the answer's characters that are letters a-m, read from
`answer.txt` in the artifact the judge receives (the built-in agent writes its final answer there). So each
execution's score must equal that rule applied to its own workspace's answer, not a constant. One task's rubric asks
the judge for a reply that is not JSON: its assessments are retried until the task's overall budget ends, then
excluded (no score, never a zero) and never trained on. One run, many assertions (241 s wall at load average 19,
55 s CPU).
"""

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gyre_eval.groups import group_advantages
from gyre_eval.testing import JudgeRequest, ScriptedJudge, judgement

ROOT = Path(__file__).resolve().parents[1]
GARBLED = "REPLY-UNPARSEABLE"  # in a rubric: the scripted judge answers with broken JSON
GARBLED_BUDGET_S = 30.0
"""The garbled task's overall budget: its harness writes an answer at once, so its assessments are retried until
this long after launch, then settle (its first submission came 11 s after launch at load average 19)."""
WRITE_ANSWER = "import uuid; open('answer.txt', 'w').write(uuid.uuid4().hex)"


def first_half_share(answer: str) -> float:
    """The scripted judge's rule: letters a-m among the answer's characters (0 for no answer)."""
    text = answer.strip().lower()
    return round(sum("a" <= c <= "m" for c in text) / len(text), 6) if text else 0.0


def _task(query_id: str, rubric: str, budget_s: float, **more) -> dict:
    return {
        "query_id": query_id,
        "prompt": "Name the code word for the river.",
        "workspace": {"empty": True},
        "scoring": {"kind": "judge", "rubric": rubric},
        "harness_timeout_s": budget_s,
        "overall_budget_s": budget_s,
        **more,
    }


def _garbled_settled(store: Path) -> bool:
    """The garbled task's assessments submitted so far are all final (their budget ran out)."""
    if not store.exists():
        return False
    con = sqlite3.connect(store, timeout=10)
    try:
        rows = con.execute("SELECT final FROM assessments WHERE evaluator = 'task-garbled'").fetchall()
    except sqlite3.OperationalError:  # the service has not created its tables yet
        return False
    finally:
        con.close()
    return bool(rows) and all(final for (final,) in rows)


@pytest.mark.slow
def test_gyre_run_scores_judge_tasks_through_the_judge_section(tmp_path):
    run_dir = tmp_path / "run"
    store = run_dir / "assessments.sqlite"

    released = threading.Event()

    def reply(req: JudgeRequest) -> str:
        if GARBLED in req.rubric:
            return '{"score": 0.9, critique: unquoted}'  # not valid JSON
        # A gate, not a guess at timing: no rubric task is judged (so no group is ready and no step can end) before
        # the garbled assessments launched with the first groups have settled.
        while not released.is_set():
            if _garbled_settled(store):
                released.set()
            released.wait(0.1)
        return judgement(first_half_share(req.files().get("answer.txt", "")), "share of letters a-m")

    harness = {"kind": "command", "command": [sys.executable, "-c", WRITE_ANSWER]}
    tasks = [
        _task("garbled", f"Score the answer. {GARBLED}", GARBLED_BUDGET_S, harness=harness),
        _task("river", "Score: the share of the answer's letters a-m.", 120.0),
        _task("lake", "Score: the share of the answer's letters a-m, again.", 120.0),
    ]
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    with ScriptedJudge(reply, api_key="judge-secret") as judge:
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
            "scheduler.N=2",
            "--set",
            "scheduler.B=2",
            "--set",
            f"judge.base_url={judge.base_url}",
            "--set",
            "judge.api_key_env=GYRE_TEST_JUDGE_KEY",
            "--set",
            "judge.model=scripted-judge",
            "--set",
            "debug.dump_batches=[0]",
        ]
        env = os.environ | {"GYRE_TEST_JUDGE_KEY": "judge-secret"}
        t0 = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=420, cwd=tmp_path, env=env)
        wall = time.monotonic() - t0
        requests, judge_url = list(judge.requests), judge.base_url
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"run wall {wall:.1f} s, {len(requests)} judge requests")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1
    for written in ("config.json", "gyre-eval.config.json"):  # the judge's key came from the environment only
        assert "judge-secret" not in (run_dir / written).read_text()

    con = sqlite3.connect(store)
    con.row_factory = sqlite3.Row
    rows = {r["execution_id"]: dict(r) for r in con.execute("SELECT * FROM assessments WHERE designated = 1")}
    attempts = {}
    for r in con.execute(
        "SELECT a.execution_id, t.ok, t.error, t.finished_at FROM attempts t JOIN assessments a "
        "ON a.id = t.assessment_id ORDER BY t.assessment_id, t.number"
    ):
        attempts.setdefault(r[0], []).append((r[1], r[2], r[3]))
    con.close()
    print({e: (r["evaluator"], r["status"], r["score"], r["attempts"]) for e, r in rows.items()})
    judged = {e: r for e, r in rows.items() if r["evaluator"] != "task-garbled"}
    garbled = {e: r for e, r in rows.items() if r["evaluator"] == "task-garbled"}

    # Every rubric task's assessment holds the judge's score for the execution's own answer (read from its
    # workspace here); one still running when the run stopped is not final yet, never a made-up score.
    valid = {}
    for eid, row in judged.items():
        if not row["final"]:
            assert (row["status"], row["score"]) == ("unresolved", None), eid
            continue
        answer_file = run_dir / "workspaces" / eid / "answer.txt"
        answer = answer_file.read_text() if answer_file.exists() else ""
        assert row["status"] == "valid", (eid, attempts[eid])
        assert row["score"] == pytest.approx(first_half_share(answer), abs=1e-9), (eid, answer)
        prov = json.loads(row["provenance"])
        assert prov["kind"] == "judge" and prov["describe"]["endpoint"] == judge_url
        assert prov["critique"] == "share of letters a-m" and prov["describe"]["model"] == "scripted-judge"
        valid[eid] = row["score"]
    assert len(valid) >= 4

    # The garbled reply: retried against the same artifact until the task's budget ran out, then excluded: no
    # score, never a zero. An attempt may find every evaluation slot taken by the gated judge requests until its
    # deadline (then it settles there): a garbled execution submitted after the gate closed meets that on its first
    # attempt (CI saw it once). Those launched last were still inside their budget when the run stopped.
    retry_errors = (
        "not valid JSON",
        "no evaluation slot was free before",
        "cut off at the execution's overall",
    )
    assert garbled
    for eid, row in garbled.items():
        assert (row["status"], row["score"]) == ("unresolved", None), eid
        assert not any(ok for ok, _, _ in attempts[eid])
        assert all(any(m in err for m in retry_errors) for _, err, _ in attempts[eid]), attempts[eid]
        if not row["final"]:
            assert max(t for _, _, t in attempts[eid]) < row["deadline"], eid
    # The first garbled submissions come before any rubric request holds a slot: the judge's reply, parsed, refused.
    parsed = {e for e in garbled if "not valid JSON" in attempts[e][0][1]}
    settled = [e for e, r in garbled.items() if r["final"]]
    assert settled, "no garbled assessment reached its budget"
    assert parsed & set(settled), {e: attempts[e] for e in garbled}
    for eid in settled:
        tries = attempts[eid]
        if eid in parsed:
            assert len(tries) >= 2, tries  # retried on the same artifact before the budget ran out
        # settled when no further attempt could start before the deadline (the retry wait is at most 2 s)
        assert attempts[eid][-1][2] <= garbled[eid]["resolved_at"]
        assert garbled[eid]["resolved_at"] >= garbled[eid]["deadline"] - 2.0
        assert "budget expired" in json.loads(garbled[eid]["provenance"])["last_error"]
    # The judge saw each task's own rubric and was asked only through the run's [judge] model.
    assert {r.rubric for r in requests} == {t["scoring"]["rubric"] for t in tasks}
    assert {r.model for r in requests} == {"scripted-judge"}

    # The scores reach the trainer: the step trained whole groups of judged executions, with the judge's scores as
    # rewards and their GRPO advantages in the trained micro-steps.
    step = json.loads((run_dir / "metrics" / "steps.jsonl").read_text().splitlines()[0])
    dump = run_dir / "metrics" / "batches" / "batch-0" / "microsteps.jsonl"
    infos = {e["execution_id"]: e for line in dump.open() for e in json.loads(line)["executions"]}
    members = {}
    for eid, info in infos.items():
        members.setdefault(info["group_id"], []).append(eid)
    assert set(members) == set(step["group_ids"]) and len(members) == 2
    assert not set(infos) & set(garbled)  # excluded executions are never trained on
    rewards = []
    for gid, eids in members.items():
        scores = [valid[e] for e in eids]  # KeyError: a trained execution without a valid judge score
        rewards += scores
        for eid, adv in zip(eids, group_advantages(scores, "grpo"), strict=True):
            assert infos[eid]["advantage"] == pytest.approx(adv, abs=1e-6), (gid, eid)
    assert step["mean_reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-9)
    print("trained:", {e: (valid[e], round(i["advantage"], 4)) for e, i in infos.items()})
