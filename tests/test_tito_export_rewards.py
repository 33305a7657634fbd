"""`gyre-tito export`: a run's trajectories with the rewards of gyre-eval's store joined, as Parquet or a dataset
folder; record logs in the old `<crc> <json>` form are read too."""

import json
import sqlite3
import subprocess
import sys

import pyarrow.parquet as pq

from gyre_eval.store import AssessmentStore
from gyre_tito.records import ExecutionRecords, encode_line, log_path
from gyre_tito.testing.synthetic import SessionDriver


def _run_dir(tmp_path, groups=None):
    """`groups`: execution -> group (default: all four in g0)."""
    groups = {"e0": "g0", "e1": "g0", "e2": "g0", "e3": "g0"} | (groups or {})
    run = tmp_path / "run"
    recs = run / "records" / "records"
    for eid in ("e0", "e1", "e2", "e3"):
        ex = ExecutionRecords(recs, eid)
        d = SessionDriver(ex)
        d.call([1, 2, 3], [4, 5])
        d.call([*d.context("c0").tolist(), 6], [7, 8, 9])
        old = list(ex.tree.records())
        ex.close()
    path = log_path(recs, "e3")  # a log written in the old format
    path.write_bytes(
        b"".join(encode_line(r.model_copy(update={"execution_id": "e3"}), legacy=True) for r in old)
    )
    store = AssessmentStore(run)
    store.close()
    con = sqlite3.connect(run / "assessments.sqlite")
    for gid in sorted(set(groups.values())):
        con.execute("INSERT INTO groups VALUES (?, 4, 4)", (gid,))
    rows = [
        ("e0", "valid", 0.75, 1),
        ("e1", "no_work", 0.0, 1),
        ("e2", "unresolved", None, 0),
        ("e3", "valid", 1.0, 1),
    ]
    for i, (eid, status, score, final) in enumerate(rows):
        con.execute("INSERT INTO executions VALUES (?, ?, ?)", (eid, groups[eid], i))
        con.execute(
            "INSERT INTO assessments (id, execution_id, branch, artifact_version, evaluator, designated, submission,"
            " submitted_at, deadline, status, score, final, provenance) VALUES (?, ?, 'main', 'final', 'task', 1,"
            " '{}', 0, 1, ?, ?, ?, '{}')",
            (f"a{i}", eid, status, score, final),
        )
    con.commit()
    con.close()
    return run


def test_export_joins_rewards(tmp_path):
    run = _run_dir(tmp_path)
    out = tmp_path / "t.parquet"
    cmd = [sys.executable, "-m", "gyre_tito.cli", "export", str(run), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["executions"] == 3 and summary["skipped"] == {"e2": "no reward (assessment unresolved)"}
    rows = pq.read_table(out).to_pylist()
    by = {}
    for row in rows:
        by.setdefault(row["execution_id"], []).append(row)
    assert set(by) == {"e0", "e1", "e3"}
    assert [x["reward"] for x in by["e0"]] == [0.75] and by["e0"][0]["assessment_status"] == "valid"
    # both outputs are targets
    assert by["e0"][0]["group_id"] == "g0" and sum(by["e0"][0]["target_mask"]) == 5
    assert by["e1"][0]["placeholder"] and by["e1"][0]["reward"] == 0.0
    # old-format log
    assert by["e3"][0]["reward"] == 1.0 and by["e3"][0]["token_ids"] == by["e0"][0]["token_ids"]

    ds = tmp_path / "ds"
    r = subprocess.run(
        [*cmd[:-2], "--out", str(ds), "--format", "dataset", "--include-unrewarded"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    rows = pq.read_table(ds / "data" / "train-00000-of-00001.parquet").to_pylist()
    assert {x["execution_id"] for x in rows} == {"e0", "e1", "e2", "e3"}
    assert [x["reward"] for x in rows if x["execution_id"] == "e2"] == [None]
    assert (ds / "README.md").exists()
    r = subprocess.run(
        [*cmd[:-3], str(tmp_path / "nothing"), "--out", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.startswith("gyre-tito export: ") and r.stderr.count("\n") == 1


def test_export_per_step_groups_rows_by_the_step_that_trained_them(tmp_path):
    run = _run_dir(tmp_path, {"e3": "g1", "e1": "g2"})
    (run / "metrics").mkdir()
    steps = [{"policy_version": 1, "group_ids": ["g1"]}, {"policy_version": 2, "group_ids": ["g0"]}]
    (run / "metrics" / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = tmp_path / "steps"
    r = subprocess.run(
        [sys.executable, "-m", "gyre_tito.cli", "export", str(run), "--out", str(out), "--per-step"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert sorted(p.name for p in out.iterdir()) == ["step-00001.parquet", "step-00002.parquet"]
    one = pq.read_table(out / "step-00001.parquet").to_pylist()
    two = pq.read_table(out / "step-00002.parquet").to_pylist()
    assert {(t["execution_id"], t["group_id"], t["step"], t["reward"]) for t in one} == {("e3", "g1", 1, 1.0)}
    assert {(t["execution_id"], t["group_id"], t["step"], t["reward"]) for t in two} == {
        ("e0", "g0", 2, 0.75)
    }
    # e1's group was never trained, e2 has no final reward
    assert summary["skipped"] == {
        "e1": "group g2 was not trained in any step",
        "e2": "no reward (assessment unresolved)",
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre_tito.cli",
            "export",
            str(run / "records"),
            "--out",
            str(out),
            "--per-step",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "steps.jsonl" in r.stderr
