"""`gyre run configs/claude-code.toml`: the real Claude Code CLI as the harness on the CPU engines, end to end.

The demo policy's 2048 positions are far below Claude Code's prompt, so the config builds a tiny random-init Qwen3
with 65536 positions (`model.builtin = "long-context"`). Two SWE tasks x N=2 in the launch sandbox, one optimizer step.
We assert that the records are the CLI's own requests (its system prompt, the four tools it was told to offer, its
user agent and billing line), that every execution the step trained on was assessed by its task's check, and that the
step trained on exactly those executions' trajectories, with the trainer's log-probs equal to the engine's (the
long real prompts are context, the CLI's outputs the targets)."""

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CLAUDE = ROOT / "node_modules" / ".bin" / "claude"


@pytest.mark.slow
def test_gyre_run_with_claude_code_on_cpu_engines(tmp_path):
    if not CLAUDE.exists():
        pytest.fail(f"Claude Code CLI not installed at {CLAUDE}: run `npm ci` at the repo root")
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        "configs/claude-code.toml",
        "--steps",
        "1",
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--set",
        "dashboard.enabled=false",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 1

    tok = Tokenizer.from_file(str(run_dir / "model" / "tokenizer.json"))
    assert json.loads((run_dir / "model" / "config.json").read_text())["max_position_embeddings"] == 65536

    trace = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]
    members = {e["group"]: e["executions"] for e in trace if e["ev"] == "dispatch"}
    (step,) = [json.loads(line) for line in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    trained = [eid for g in step["group_ids"] for eid in members[g]]
    assert len(step["group_ids"]) == 2 and len(trained) == step["num_executions"] == 4

    con = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = con.execute("SELECT execution_id, evaluator, status, score FROM assessments WHERE designated = 1")
    assessed = {eid: (ev, status, score) for eid, ev, status, score in rows.fetchall()}
    con.close()
    # the model does not edit the repositories: each workspace scores what its starting repo scores
    start = {"task-swe-fizzbuzz": 0.5, "task-swe-slugify": 0.25}
    assert set(trained) <= set(assessed)
    assert {v for v in assessed.values()} <= {(ev, "valid", s) for ev, s in start.items()}

    tasks = (ROOT / "tasks" / "swe" / "tasks.jsonl").read_text().splitlines()
    prompts = {t["query_id"]: t["prompt"] for t in map(json.loads, tasks)}
    targets = 0
    for eid in trained:
        log = run_dir / "records" / "records" / f"{eid}.tito.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert records and all(r["role_class"] == "main/task" for r in records)
        first = records[0]
        assert first["parent_id"] is None and all(r["parent_id"] for r in records[1:])  # one chain
        meta = first["metadata"]
        assert meta["api"] == "anthropic" and meta["user_agent"].startswith("claude-cli/")
        assert meta["volatile"][0].startswith("x-anthropic-billing-header: cc_version=")
        prompt = tok.decode(first["input_ids"], skip_special_tokens=False)
        assert len(first["input_ids"]) > 5000  # the real prompt: far beyond the demo policy's 2048 positions
        assert "You are an interactive agent that helps users with software engineering tasks" in prompt
        offered = re.findall(r'\{"type": "function", "function": \{"name": "(\w+)"', prompt)
        assert sorted(offered) == ["Bash", "Edit", "Read", "Write"]  # [harness] tools
        task = prompts[assessed[eid][0].removeprefix("task-")]
        assert task in prompt  # the task, as the CLI's user message
        assert {r["metadata"]["sampling"]["used"]["temperature"] for r in records} == {1.0}
        assert all(len(r["output_ids"]) <= 32 for r in records)  # [harness] max_output_tokens
        (traj,) = pq.read_table(run_dir / "trajectories" / f"{eid}.parquet").to_pylist()
        assert traj["token_ids"][: len(first["input_ids"])] == first["input_ids"]
        assert sum(traj["target_mask"]) == sum(len(r["output_ids"]) for r in records)
        targets += sum(traj["target_mask"])

    # the step trained on exactly these trajectories; at d=0 the trainer's log-probs are the engine's
    assert step["num_target_tokens"] == targets
    assert abs(step["metrics"]["mean_log_ratio_d0"]) < 1e-5 and step["metrics"]["ratio_dev_max"] < 1e-4
    assert (run_dir / "checkpoints" / "policy-v1").is_dir()
