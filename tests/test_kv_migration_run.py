"""`gyre run` role switches with KV-cache migration (issue 17): when an elastic cell leaves rollout, the proxy's drain
pins its in-flight calls and its executions' cached contexts, and the engines on their new routes take them over.
The controller writes the proxy's migration totals after each drain into RUN/metrics/switches.jsonl."""

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
    argv = [sys.executable, "-m", "gyre.cli", "run", str(ROOT / "configs" / "elastic-k3.toml")]
    argv += ["--run-dir", str(run_dir), "--set", "train.steps=3"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics" / "switches.jsonl").read_text().splitlines()]
    drains = [r["kv_migration"] for r in rows if "kv_migration" in r]
    assert drains, rows  # at least one cell went rollout -> training through a proxy drain
    last = drains[-1]  # totals: monotone over the run
    assert last["migrated"] > 0 and last["migrated_tokens"] > 0 and last["bytes"] > 0, drains
