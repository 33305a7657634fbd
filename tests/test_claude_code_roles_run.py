"""J_max role priority deciding in a real `gyre run` (docs/design/tito.md#provenance-mask-and-selection):
`configs/claude-code-roles.toml`, the real Claude Code CLI with a main agent, a sub-agent and a compaction in every
execution.

The engines play a documented script (`[rollout] scripted_replies`, gyre_cell.engine.script: the script picks the
tokens, the policy gives each its own log-prob), because a tiny random-init policy cannot make Claude Code delegate or
compact. Each execution's tree has three leaves: the summary call that ends the pre-compaction main chain
(main/summary), the main agent after the compaction (main/task) and the sub-agent (sub/task). With J_max = 2 the
priority admits main/task, then main/summary, and never the sub-agent, whose calls are recorded all the same. The step
trains exactly the admitted targets, with the trainer's log-probs equal to the recorded ones at staleness 0."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gyre_tito.types import ROLE_PRIORITY

ROOT = Path(__file__).resolve().parents[1]
J_MAX = 3  # [train] j_max of configs/claude-code-roles.toml
CLAUDE = ROOT / "node_modules" / ".bin" / "claude"


@pytest.mark.slow
def test_role_priority_decides_what_a_claude_code_run_trains(tmp_path):
    if not CLAUDE.exists():
        pytest.fail(f"Claude Code CLI not installed at {CLAUDE}: run `npm ci` at the repo root")
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        "configs/claude-code-roles.toml",
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--set",
        "dashboard.enabled=false",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 1

    trace = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]
    members = {e["group"]: e["executions"] for e in trace if e["ev"] == "dispatch"}
    (step,) = [json.loads(line) for line in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    trained = [eid for g in step["group_ids"] for eid in members[g]]
    assert len(trained) == 4

    targets = 0
    for eid in trained:
        records = [json.loads(x) for x in (run_dir / "records" / "records" / f"{eid}.tito.jsonl").open()]
        by_class: dict[str, list[dict]] = {}
        for r in records:
            by_class.setdefault(r["role_class"], []).append(r)
        # the CLI delegated and compacted: every class was recorded
        assert {"main/task", "main/summary", "sub/task"} <= set(by_class), sorted(by_class)
        written = run_dir / "workspaces" / eid / "sub.txt"
        assert written.read_text() == "from-sub\n"  # the sub-agent's Bash ran, in the sandbox
        # The tree's leaves (calls no other call continues) and their classes: more leaves than J_max, so the
        # priority decides which are admitted; each leaf's own call has output tokens, so each could be.
        parents = {r["parent_id"] for r in records}
        leaves = [r for r in records if r["call_id"] not in parents and r["role_class"] != "other"]
        assert len(leaves) > J_MAX and all(r["output_ids"] for r in leaves)
        expected = sorted((r["role_class"] for r in leaves), key=ROLE_PRIORITY.index)[:J_MAX]
        assert "sub/task" not in expected and "main/summary" in expected  # the summary outranks the sub-agent
        trajectories = pq.read_table(run_dir / "trajectories" / f"{eid}.parquet").to_pylist()
        assert [t["role_class"] for t in trajectories] == expected
        # every admitted target is a main-agent token, once; no sub-agent token is trained
        classes = {r["call_id"]: r["role_class"] for r in records}
        admitted = sum(sum(t["target_mask"]) for t in trajectories)
        assert admitted == sum(
            len(r["output_ids"]) for r in records if classes[r["call_id"]].startswith("main/")
        )
        targets += admitted

    assert step["num_target_tokens"] == targets
    assert abs(step["metrics"]["mean_log_ratio_d0"]) < 1e-5 and step["metrics"]["ratio_dev_max"] < 1e-4
