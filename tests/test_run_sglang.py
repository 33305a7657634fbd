"""`gyre run` with `[rollout] engine = "sglang"`: every cell worker starts, watches and updates its own SGLang server.

SGLang cannot run here, so each server is `gyre_cell.testing.sglang_stand_in` (the CPU torch engine behind SGLang's flags,
its token by SGLang's `--config` file). The run is otherwise the real one: the proxy routes model calls to the
servers, not to the workers; published weights reach the core's server from its own buffer and the satellites'
from Mooncake, pushed over HTTP; the servers die with their workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from gyre_sched.trace import iter_trace, read_trace

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_an_elastic_run_serves_rollout_from_sglang_servers_its_cells_supervise(tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(ROOT / "configs" / "elastic-k3.toml"),
        "--run-dir",
        str(run_dir),
        "--steps",
        "4",
        "--quiet",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "debug.hold_core_for_join=1",
        "--set",
        "rollout.engine=sglang",
        "--set",
        "rollout.sglang.module=gyre_cell.testing.sglang_stand_in",
    ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1])["steps"] == 4  # two bursts: the second rolls out at v2

    # Each cell's engine is its SGLang server, on a port of its own: that is where the proxy routed model calls.
    services = json.loads((run_dir / "services.json").read_text())
    servers, workers = services["cells"], services["workers"]
    configs = [json.loads((run_dir / "cells" / f"cell-{i}.json").read_text()) for i in range(3)]
    assert servers == [f"http://127.0.0.1:{c['sglang']['port']}" for c in configs]
    assert not set(servers) & set(workers)
    spans = [
        s
        for p in (run_dir / "trajectories").glob("*.parquet")
        for row in pq.read_table(p).to_pylist()
        for s in row["weight_versions"]
    ]
    assert spans and {s["engine_id"] for s in spans} <= set(servers)
    # Published weights reached every server. The satellites' from Mooncake: published to both, each served version 2
    # (published after the first burst) in the second. The core's from its own buffer as it went back to rollout:
    # whether it then served a call before it went to training again is the policy's timing (CI's loaded run had its
    # executions moved off it first), so its switch report says what it pushed to its server.
    by_server = {url: {int(s["weight_version"]) for s in spans if s["engine_id"] == url} for url in servers}
    assert all(2 in by_server[url] for url in servers[1:]), by_server
    publishes = [json.loads(r) for r in (run_dir / "metrics" / "publish.jsonl").read_text().splitlines()]
    assert any(p["version"] == 2 and p["transport"] == "mooncake" and p["engines"] >= 2 for p in publishes), (
        publishes
    )
    switches = [json.loads(r) for r in (run_dir / "metrics" / "switches.jsonl").read_text().splitlines()]
    core_loads = [s["weight_version"] for s in switches if s["cell"] == "0" and s["to_role"] == "rollout"]
    assert "2" in core_loads, switches
    assert by_server[servers[0]] <= {0, *map(int, core_loads)}, by_server
    # The satellites trained: micro-steps claimed by more than one cell.
    claims = {x["cell"] for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] == "microstep_claim"}
    assert len(claims) >= 2, claims
    trace = read_trace(run_dir / "trace.jsonl")
    state = json.loads((run_dir / "metrics" / "scheduler.json").read_text())
    assert (trace.d, trace.p, trace.f, trace.x) == (state["d"], state["p"], state["f"], state["x"])
    # Each server logged to RUN/logs, got the token by file (never argv), and is gone with its worker.
    for i in range(3):
        assert (run_dir / "logs" / f"cell-{i}.sglang.log").read_text().strip()
    ports = {f"--port {c['sglang']['port']}" for c in configs}
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "gyre_cell.testing.sglang_stand_in" in " ".join(p.info["cmdline"] or ())
        and any(port in " ".join(p.info["cmdline"]) for port in ports)
    ]
    assert left == []
