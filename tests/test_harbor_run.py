"""Harbor tasks in a real `gyre run` (`configs/harbor.toml`): the shipped Harbor-format suite (tasks/harbor), each
execution in the launch sandbox with the built-in harness, each scored by its task's own verifier (tests/test.sh under
bubblewrap, gyre.harbor_verify).

The engines play the config's script: on count-words the reply is the right count (the built-in agent writes it to
answer.txt), on fix-clamp a reply that changes nothing. So count-words scores 1.0 where its starting workspace scores 0
and fix-clamp what its start scores, 0.75: both numbers are the verifiers' (tests/test_harbor_tasks.py checks the
starts and the reference solutions)."""

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("bwrap") is None, reason="the launch sandbox and the verifiers need bubblewrap"
    ),
]


def test_gyre_run_scores_harbor_tasks_with_their_own_verifiers(tmp_path):
    config = (ROOT / "configs" / "harbor.toml").read_text()
    for rel in ("configs/harbor.script.json", "tasks/harbor"):
        config = config.replace(f'"{rel}"', json.dumps(str(ROOT / rel)))
    (tmp_path / "harbor.toml").write_text(config)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(tmp_path / "harbor.toml"),
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--set",
        "dashboard.enabled=false",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 1

    con = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = con.execute(
        "SELECT a.execution_id, a.evaluator, a.status, a.score, t.details FROM assessments a "
        "JOIN attempts t ON t.assessment_id = a.id AND t.ok = 1 WHERE a.designated = 1"
    ).fetchall()
    con.close()
    assert {(ev, status, score) for _, ev, status, score, _ in rows} == {
        ("task-count-words", "valid", 1.0),
        ("task-fix-clamp", "valid", 0.75),
    }, rows
    for eid, ev, _, _, details in rows:
        out = json.loads(details)["stdout_tail"]
        assert out.startswith("harbor verifier: bubblewrap root")  # scored by test.sh, in its own root
        if ev == "task-count-words":
            assert "expected 18, answered '18'" in out
            assert (run_dir / "workspaces" / eid / "answer.txt").read_text().strip() == "18"
            assert (run_dir / "workspaces" / eid / "notes.txt").is_file()  # the Dockerfile's COPY line
        else:
            assert "clamp(12, 0, 10) == 10: FAILED" in out
        records = [json.loads(x) for x in (run_dir / "records" / "records" / f"{eid}.tito.jsonl").open()]
        assert records and all(len(r["output_ids"]) == len(r["output_logprobs"]) > 0 for r in records)
