"""The launch sandbox inside a whole `gyre run`: a probe task's harness (a command, per-task override) tries to read
the host environment, the host's home folder, the run's proxy store, its resolved config and assessment store, and
another execution's workspace, and to reach an address other than the proxy. Every attempt fails, while its own
model call through the proxy is recorded, and the run assesses and trains on the probes like any other task.

The runner's unit-level probe (tests/test_harness_sandbox.py) drives an `ExecutionRunner` by hand; this one goes
through `gyre demo`'s launcher, controller, proxy, evaluator and trainer with `harness.sandbox = true`, under each
sandbox runtime (bubblewrap, and an OCI runtime: runc).
"""

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

PROBE = (Path(__file__).parent / "sandbox_probe.py").read_text()
CHECK = """
import json, os
try:
    out = json.load(open("probe.json"))
except (OSError, ValueError):
    out = {}
score = 1.0 if out.get("proxy_call", [""])[0] == "succeeded" else 0.0
open(os.environ["GYRE_SCORE_FILE"], "w").write(repr(score))
"""


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["bubblewrap", "oci"])
def test_probe_task_in_a_gyre_run_reaches_nothing_but_the_proxy(tmp_path, runtime):
    binary = {"bubblewrap": "bwrap", "oci": "runc"}[runtime]
    if shutil.which(binary) is None:
        pytest.fail(f"{binary} is not installed: apt-get install {binary.replace('bwrap', 'bubblewrap')}")
    run_dir = tmp_path / "run"
    # gyre-eval runs the check as an unprivileged user: its files must be readable by others (pytest's tmp_path
    # lies under a 0700 folder).
    checks = Path(tempfile.mkdtemp(prefix="gyre-probe-check-"))
    checks.chmod(0o755)
    (checks / "check.py").write_text(CHECK)
    home_secret = Path.home() / f".gyre-probe-{uuid.uuid4().hex}"
    home_secret.write_text("host home secret")
    listener = socket.create_server(("127.0.0.1", 0))  # a host service that is not the proxy
    canary = f"canary-{uuid.uuid4().hex}"
    paths = {
        "read": {
            "host_home_file": str(home_secret),
            "run_config": str(run_dir / "config.json"),
            "assessment_store": str(run_dir / "assessments.sqlite"),
            "proxy_registry": str(run_dir / "records" / "executions.jsonl"),
            "host_environ": "/proc/1/environ",
        },
        "host_home": str(Path.home()),
        "workspaces": str(run_dir / "workspaces"),
        "connect": {"host_listener": ["127.0.0.1", listener.getsockname()[1]], "outside": ["1.1.1.1", 80]},
    }
    task = {
        "query_id": "probe",
        "prompt": "Probe the sandbox.",
        "workspace": {"empty": True},
        "scoring": {
            "kind": "exec",
            "command": ["/usr/bin/python3", "-I", "{files}/check.py"],
            "files": str(checks),
            "score_from": "score_file",
            "timeout_s": 60,
        },
        "harness": {"kind": "command", "command": [sys.executable, "-c", PROBE, json.dumps(paths)]},
        "harness_timeout_s": 120,
        "overall_budget_s": 240,
    }
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text(json.dumps(task) + "\n")
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--steps",
        "1",
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--set",
        f"tasks.file={task_file}",
        "--set",
        "harness.sandbox=true",
        "--set",
        f"harness.sandbox_runtime={runtime}",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "scheduler.N=2",
        "--set",
        "scheduler.B=1",
        "--set",
        "scheduler.mu=1",
        "--set",
        "scheduler.phi=0",
    ]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=600, env=os.environ | {"GYRE_CANARY": canary}
        )
    finally:
        home_secret.unlink()
        listener.close()
        shutil.rmtree(checks, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 1

    outs = {
        p.name: json.loads((p / "probe.json").read_text())
        for p in (run_dir / "workspaces").iterdir()
        if (p / "probe.json").exists()
    }
    assert len(outs) >= 2, sorted(p.name for p in (run_dir / "workspaces").iterdir())
    for eid, out in outs.items():
        assert out["proxy_call"][0] == "succeeded", (eid, out["proxy_call"])  # its own call reaches the proxy
        for key in paths["read"]:
            if key == "host_environ":  # its pid 1 is the sandbox's own init
                assert canary not in json.dumps(out["read:" + key]), out["read:" + key]
            else:
                assert out["read:" + key][0] == "failed", (eid, key, out["read:" + key])
        listed = out["list:other_workspaces"]
        assert listed[0] == "failed" or not any(f"'{o}'" in listed[1] for o in outs if o != eid), (
            eid,
            listed,
        )
        assert out["list:host_home"][0] == "failed" or home_secret.name not in out["list:host_home"][1]
        assert out["connect:host_listener"][0] == "failed" and out["connect:outside"][0] == "failed", out
        assert "GYRE_CANARY" not in out["env"] and out["uid"] == 65534, out["env"]
        assert not any("ADMIN" in k or "TOKEN" in k for k in out["env"]), out["env"]
        assert out["spawn_64"][0] == "succeeded"  # the run's default pids limit (512) leaves room for 64

    # Recorded, assessed and trained like any task: each probe's call is in the proxy's records, each execution the
    # step trained on was scored 1.0 by the task's check (its proxy call succeeded).
    for eid in outs:
        log = run_dir / "records" / "records" / f"{eid}.tito.jsonl"
        assert log.exists() and len(log.read_text().splitlines()) == 1, eid
    step = json.loads((run_dir / "metrics" / "steps.jsonl").read_text().splitlines()[0])
    con = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = con.execute("SELECT execution_id, status, score FROM assessments WHERE designated = 1").fetchall()
    con.close()
    scored = {eid: (status, score) for eid, status, score in rows}
    assert step["num_executions"] == 2 and step["mean_reward"] == pytest.approx(1.0)
    assert {scored[eid] for eid in outs if eid in scored} == {("valid", 1.0)}
