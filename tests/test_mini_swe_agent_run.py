"""mini-swe-agent, a second real harness, in a `gyre run` (`configs/mini-swe-agent.toml`): the real `mini` CLI
(2.4.6, from an environment of its own: its litellm pins an openai release the workspace does not use) in the
launch sandbox, on the SWE suite, calling the proxy's OpenAI endpoint with its `bash` tool.

The engines play the config's script (a tiny random-init policy cannot write a fix; the policy gives each scripted
token its own log-prob): on fizzbuzz the first call rewrites fizzbuzz.py, then every execution submits. So the task's
own hidden-test check scores fizzbuzz 1.0 (its starting repository scores 0.5) and slugify what it starts with, 0.25:
the reward comes from what mini-swe-agent's commands did inside the sandbox."""

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _mini_env() -> Path:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "stack_venv.py"),
            "mini-swe-agent",
            "mini-swe-agent==2.4.6",
            "litellm>=1.108",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1]).parent.parent


def test_mini_swe_agent_fixes_fizzbuzz_in_the_sandbox_and_every_call_is_recorded(tmp_path):
    venv = _mini_env()
    config = (ROOT / "configs" / "mini-swe-agent.toml").read_text()
    config = config.replace("~/.venvs/mini", str(venv))
    config = config.replace(
        '"configs/mini-swe-agent.script.json"',
        json.dumps(str(ROOT / "configs" / "mini-swe-agent.script.json")),
    )
    config = config.replace(
        '"tasks/swe/tasks.jsonl"', json.dumps(str(ROOT / "tasks" / "swe" / "tasks.jsonl"))
    )
    (tmp_path / "mini.toml").write_text(config)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(tmp_path / "mini.toml"),
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--set",
        "dashboard.enabled=false",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 1

    con = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = con.execute(
        "SELECT execution_id, evaluator, status, score FROM assessments WHERE designated = 1"
    ).fetchall()
    con.close()
    scores = {(ev, status, score) for _, ev, status, score in rows}
    # mini-swe-agent's fix, checked by the hidden tests
    assert ("task-swe-fizzbuzz", "valid", 1.0) in scores, rows
    assert scores <= {("task-swe-fizzbuzz", "valid", 1.0), ("task-swe-slugify", "valid", 0.25)}, rows
    for eid, ev, _, _ in rows:
        records = [json.loads(x) for x in (run_dir / "records" / "records" / f"{eid}.tito.jsonl").open()]
        # two bash tool calls through the proxy (the work, then the submit that ends mini-swe-agent), each
        # recorded with its tokens and behaviour log-probs
        assert len(records) == 2
        assert all(len(r["output_ids"]) == len(r["output_logprobs"]) > 0 for r in records)
        if ev == "task-swe-fizzbuzz":
            fixed = (run_dir / "workspaces" / eid / "fizzbuzz.py").read_text()
            assert fixed.index("% 15") < fixed.index("% 3")  # the command ran in the execution's workspace
    trajectories = [
        t for p in (run_dir / "trajectories").glob("*.parquet") for t in pq.read_table(p).to_pylist()
    ]
    assert trajectories and all(sum(t["target_mask"]) > 0 for t in trajectories)
    (step,) = [json.loads(x) for x in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert abs(step["metrics"]["mean_log_ratio_d0"]) < 1e-5  # trained on exactly what the engines sampled
