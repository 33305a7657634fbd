"""`gyre run` role switches with KV-cache migration (issue 17): when an elastic cell leaves rollout, the proxy's drain
pins its in-flight calls and its executions' cached contexts, and the engines on their new routes take them over.
The controller writes the proxy's migration totals after each drain into RUN/metrics/switches.jsonl, and every move
(with what the moved execution's next call was served from) into RUN/metrics/kv_reroutes.jsonl at the end.

The executions run `turns_harness.py`: a fixed number of chat turns, each extending the previous call's context, so
an execution moved at a drain keeps calling the model after its KV moved. Which executions are still running when a
cell leaves rollout is the policy's timing: with one length for all, a CI run's three drains found nothing running
(the cells' executions had ended just before each switch). So group g3, which the first dispatch places on the core
(destinations are filled from the highest cell down: g0, g1.e0-1 on cell 2, g1.e2-3, g2 on cell 1, g3, g4.e0-1 on
cell 0), makes 48 turns instead of 30: when g0 or g2 is ready the core leaves rollout with g3 still mid-way (its
executions fit the other two cells), and they move and call again on their new engines.

The same run checks the stall watchdog (issue 18): one execution's harness hangs; with `[agent] stall_detect_s` it
ends `stalled`, is never assessed, its group is dropped (N = N_d) and the run still completes its steps. The hang
starts at t=0 (its group is dispatched first); the watchdog must fire before the run ends, which 3 steps with a 15 s
window did not on an idle machine (the run ended at t=15 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_role_switch_moves_kv_and_the_moved_executions_are_served_from_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    harness = [sys.executable, "-I", str(ROOT / "tests" / "turns_harness.py"), "--task", "{task}"]
    # 30 turns: an execution moved at a switch is mid-way and calls again (with 12, a CI run moved only executions
    # that were in their last turn, and no move was served). 48 in g3 (docstring); about 30 tokens a turn, so its
    # context stays inside the demo policy's 2048 positions.
    harness += ["--turns", "30", "--max-tokens", "16", "--hang-in", "g1.e3"]
    harness += ["--long-in", "g3.", "--long-turns", "48"]
    argv = [sys.executable, "-m", "gyre.cli", "run", str(ROOT / "configs" / "elastic-k3.toml")]
    argv += ["--run-dir", str(run_dir), "--set", "train.steps=4", "--set", "dashboard.enabled=false"]
    argv += ["--set", "harness.kind=command", "--set", f"harness.command={json.dumps(harness)}"]
    # Fires at ~9 s; 4 steps end past 20 s even on an idle machine.
    argv += ["--set", "agent.stall_detect_s=8"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = run_dir / "metrics"
    rows = [json.loads(x) for x in (metrics / "switches.jsonl").read_text().splitlines()]
    drains = [r["kv_migration"] for r in rows if "kv_migration" in r]
    assert drains, rows  # at least one cell went rollout -> training through a proxy drain
    last = drains[-1]  # totals: monotone over the run
    assert last["migrated"] > 0 and last["migrated_tokens"] > 0 and last["bytes"] > 0, drains
    moves = [json.loads(x) for x in (metrics / "kv_reroutes.jsonl").read_text().splitlines()]
    installed = [m for m in moves if m["status"] == "installed"]
    assert installed and all(m["migrated_tokens"] > 0 and m["nbytes"] > 0 for m in installed), moves
    # a moved execution called the model again on its new engine: that call was served from the migrated blocks
    served = [m for m in installed if m["served_tokens"]]
    assert served, moves
    for m in served:
        assert m["served_tokens"] == m["migrated_tokens"] and m["recomputed_tokens"] == 0, m
        assert m["destination"] != m["source"], m
    # the hung execution: stopped by the watchdog, excluded without an assessment, its group dropped
    trace = [json.loads(x) for x in (run_dir / "trace.jsonl").read_text().splitlines()[1:]]
    ends = {e["execution"]: e["outcome"] for e in trace if e["ev"] == "terminate"}
    assert ends["g1.e3"] == "stalled" and list(ends.values()).count("stalled") == 1, ends
    assert not [e for e in trace if e["ev"] == "assessed" and e["execution"] == "g1.e3"]
    assert [e for e in trace if e["ev"] == "group_dropped" and e["group"] == "g1"]
