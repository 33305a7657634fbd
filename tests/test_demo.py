"""`gyre demo`: the whole loop for real on this machine (tiny model, CPU engines, proxy, agent, evaluator, trainer)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from gyre.cli import main
from gyre_sched.trace import read_trace


def test_config_prints_resolved_defaults(capsys):
    assert main(["config", "--set", "train.steps=7"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["train"]["steps"] == 7
    assert cfg["cluster"]["cells"] == 2
    assert cfg["scheduler"]["kind"] == "elastic" and cfg["train"]["loss"]["weight_cap"] == 5.0


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("scheduler.phi=0.25", "phi * B must be a non-negative whole number"),
        ("scheduler.kind=fastest", "scheduler.kind"),
        ("train.bogus=1", "train.bogus"),
        ("nonsense", "expected key=value"),
        ("scheduler.kind=colocate", "colocate with phi > 0 needs a standalone pool"),
        ("cluster.standalone_engines=1", "cluster.standalone_capacity"),
    ],
)
def test_bad_config_is_a_clear_cli_error(override, needle, capsys):
    assert main(["demo", "--set", override]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.slow
def test_demo_runs_the_whole_loop(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "demo", "--run-dir", str(run_dir), "--steps", "2"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2

    config = json.loads((run_dir / "config.json").read_text())
    assert config["train"]["steps"] == 2 and config["run_dir"] == str(run_dir)

    # Counters, steps and staleness recomputed from the trace alone.
    trace = read_trace(run_dir / "trace.jsonl")
    assert trace.steps >= 2
    assert 0 <= trace.f <= trace.p <= trace.d - trace.x
    assert trace.staleness[:4] == [0, 0, 0, 0] or all(d >= 0 for d in trace.staleness)
    assert any(role == "training" for cell in trace.roles for _, _, role in cell)

    # Every consumed execution was scored by the task's rule on its own artifact.
    db = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = db.execute(
        "SELECT execution_id, evaluator, status, score FROM assessments WHERE designated = 1"
    ).fetchall()
    assert rows
    for execution_id, evaluator, status, score in rows:
        assert status == "valid"
        letter = evaluator.rsplit("-", 1)[1]
        text = (run_dir / "workspaces" / execution_id / "answer.txt").read_text(errors="replace")
        expected = text.count(letter) / len(text) if text else 0.0
        assert score == pytest.approx(expected, abs=1e-9)

    # Selected trajectories: targets only where the policy produced tokens, behaviour log-probs on every target.
    tables = [pq.read_table(p) for p in (run_dir / "trajectories").glob("*.parquet")]
    assert tables
    targets = 0
    for table in tables:
        for row in table.to_pylist():
            mask, logprobs = row["target_mask"], row["behavior_logprobs"]
            assert len(mask) == len(row["token_ids"]) == len(logprobs)
            targets += sum(mask)
            assert all(lp <= 0.0 for lp, m in zip(logprobs, mask, strict=True) if m)
    assert targets > 0

    steps = [json.loads(line) for line in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == [1, 2]
    assert all(s["num_target_tokens"] > 0 and s["num_executions"] == 8 for s in steps)
    assert (run_dir / "checkpoints" / "policy-v2" / "config.json").exists()  # the final version, saved

    # Role switches went through gyre-cell's role manager (pause, flush, release / offload, resume, load, continue).
    switches = [
        json.loads(line) for line in (run_dir / "metrics" / "switches.jsonl").read_text().splitlines()
    ]
    to_training = [s for s in switches if s["to_role"] == "training"]
    assert to_training and [p["name"] for p in to_training[0]["phases"]][:3] == [
        "pause_generation", "flush_cache", "release_memory",
    ]  # fmt: skip
    assert all(s["weight_version"] is not None for s in switches if s["to_role"] == "rollout")
    report = (run_dir / "report.html").read_text()
    assert "window.GYRE_DATA" in report and "mean reward" in report  # the dashboard's views, static

    # A second run never overwrites the first one's records.
    before = (run_dir / "trace.jsonl").read_bytes()
    assert main(["demo", "--run-dir", str(run_dir)]) == 2
    assert (run_dir / "trace.jsonl").read_bytes() == before
