"""Task datasets: JSONL / Parquet / dataset folder load the same tasks; malformed files give one clear line."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gyre.datasets import (
    DirWorkspace,
    ExecScoring,
    TaskFileError,
    load_tasks,
    setup_workspace,
    unreadable_check_files,
)


@pytest.fixture
def base(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "a.txt").write_text("hello\n")
    (tmp_path / "check").mkdir()
    (tmp_path / "check" / "hidden.py").write_text("print(1)\n")
    return tmp_path


def _task(**kw):
    t = {
        "query_id": "t1",
        "prompt": "Fix it.",
        "workspace": {"dir": "ws"},
        "scoring": {"kind": "exec", "command": ["python3", "$GYRE_CHECK_FILES/hidden.py"], "files": "check"},
        "harness_timeout_s": 60,
        "overall_budget_s": 120,
    }
    t.update(kw)
    return {k: v for k, v in t.items() if v is not None}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_folder_give_the_same_tasks(base):
    rows = [_task(), _task(query_id="t2", harness="claude-code", metadata={"k": 1})]
    jl = load_tasks(_write(base / "tasks.jsonl", rows))
    assert [t.query_id for t in jl] == ["t1", "t2"]
    assert isinstance(jl[0].workspace, DirWorkspace) and jl[0].workspace.dir == str(base / "ws")
    assert isinstance(jl[0].scoring, ExecScoring) and jl[0].scoring.files == str(base / "check")
    assert jl[1].harness.kind == "claude-code" and jl[1].metadata == {"k": 1}
    flat = [{**r, **{k: json.dumps(r[k]) for k in ("workspace", "scoring")}} for r in rows]
    flat[1]["metadata"] = json.dumps(flat[1]["metadata"])
    for r in flat:
        r.setdefault("harness", None)
        r.setdefault("metadata", None)
    pq.write_table(pa.Table.from_pylist(flat), base / "tasks.parquet")
    assert load_tasks(base / "tasks.parquet") == jl
    (base / "hf" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), base / "hf" / "data" / "train-00000.parquet")  # struct columns
    (base / "hf" / "ws").symlink_to(base / "ws")
    (base / "hf" / "check").symlink_to(base / "check")
    assert [t.query_id for t in load_tasks(base / "hf")] == ["t1", "t2"]


def test_workspaces_are_materialized(base, tmp_path):
    with tarfile.open(base / "ws.tar.gz", "w:gz") as tf:
        tf.add(base / "ws" / "a.txt", arcname="src/a.txt")
    repo = base / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f.txt").write_text("v1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "1"], check=True)
    sha = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    (repo / "f.txt").write_text("v2\n")
    subprocess.run([*git, "commit", "-qam", "2"], check=True)
    rows = [
        _task(),
        _task(query_id="tar", workspace={"tar": "ws.tar.gz"}),
        _task(query_id="git", workspace={"git": "repo", "commit": sha}),
        _task(query_id="empty", workspace={"empty": True}),
    ]
    tasks = load_tasks(_write(base / "tasks.jsonl", rows))
    out = tmp_path / "out"
    assert (setup_workspace(tasks[0], out / "0") / "a.txt").read_text() == "hello\n"
    assert (setup_workspace(tasks[1], out / "1") / "src" / "a.txt").read_text() == "hello\n"
    assert (setup_workspace(tasks[2], out / "2") / "f.txt").read_text() == "v1\n"
    assert list(setup_workspace(tasks[3], out / "3").iterdir()) == []


MALFORMED = [
    (['{"query_id": "t1",'], "tasks.jsonl:1: not valid JSON"),
    (["[1, 2]"], "tasks.jsonl:1: a task must be a JSON object, got list"),
    ([_task(), _task(prompt=None)], "tasks.jsonl:2: prompt: required field missing"),
    ([_task(colour="red")], "tasks.jsonl:1: colour: unknown field"),
    ([_task(harness_timeout_s=600)], "tasks.jsonl:1: harness_timeout_s (600) > overall_budget_s (120)"),
    ([_task(), "", _task()], "tasks.jsonl:3: query_id: 't1' already used at "),
    ([_task(workspace={"folder": "ws"})], "tasks.jsonl:1: workspace: must be one of"),
    ([_task(workspace={"dir": "nowhere"})], "tasks.jsonl:1: workspace.dir: no such folder: "),
    ([_task(scoring={"kind": "exec", "command": ["true"], "files": "ws"})], "lies inside the workspace"),
    ([_task(scoring={"kind": "vibes"})], "tasks.jsonl:1: scoring: Input tag 'vibes' found using 'kind'"),
    ([_task(harness_timeout_s="soon")], "tasks.jsonl:1: harness_timeout_s: Input should be a valid number"),
    ([_task(harness={"kind": "emacs"})], "tasks.jsonl:1: harness.kind: Input should be 'builtin', 'command'"),
]


@pytest.mark.parametrize("rows,expected", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_files_give_one_clear_line(base, rows, expected):
    path = _write(base / "tasks.jsonl", rows)
    with pytest.raises(TaskFileError) as e:
        load_tasks(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(base)) and expected in msg, msg


def test_gyre_tasks_validate_cli(base):
    good = _write(base / "good.jsonl", [_task()])
    bad = _write(base / "bad.jsonl", [_task(), _task(query_id="x", scoring=None)])
    cmd = [sys.executable, "-m", "gyre.cli", "tasks", "validate"]
    r = subprocess.run([*cmd, str(good)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"{good}: 1 tasks OK", r.stderr
    r = subprocess.run([*cmd, str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"{bad}:2: scoring: required field missing"]


@pytest.mark.skipif(
    os.geteuid() != 0, reason="checks drop to an unprivileged user only when gyre runs as root"
)
def test_validate_warns_when_an_unprivileged_check_could_not_read_its_files():
    """Run as root, gyre-eval runs each check as its own unprivileged user, which reads the check files in place."""
    top = Path(tempfile.mkdtemp(prefix="gyre-check-files-"))  # pytest's own tmp folders are 0700
    try:
        os.chmod(top, 0o755)
        (top / "ws").mkdir()
        (top / "check").mkdir()
        (top / "check" / "hidden.py").write_text("print(1)\n")
        good = _write(top / "tasks.jsonl", [_task()])
        cmd = [sys.executable, "-m", "gyre.cli", "tasks", "validate", str(good)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert (r.returncode, r.stdout.strip(), r.stderr) == (0, f"{good}: 1 tasks OK", "")
        os.chmod(top / "check", 0o700)
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == f"{good}: 1 tasks OK"
        assert r.stderr.strip().splitlines() == [
            f"warning: scoring.files {top / 'check'}: checks run as an unprivileged user, who cannot read "
            f"{top / 'check'} (mode 700); every assessment would fail: chmod o+rx"
        ]
        os.chmod(top / "check", 0o755)
        os.chmod(top, 0o700)  # a folder above it that others cannot enter
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert f"who cannot enter {top} (mode 700)" in r.stderr
        assert unreadable_check_files(load_tasks(good)) == r.stderr.strip().splitlines()
    finally:
        shutil.rmtree(top)
