"""`gyre run`: the paper's system as real processes, for every scheduler policy (slow: each test is a real run).

Each run starts one cell worker process per cell (CPU engine + training side), the standalone engines and the TITO
proxy; the built-in agent makes several model calls per execution; the core streams micro-steps that the training
cells claim. Every test reads what the run left behind: trace, metrics, checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gyre_sched.replay import predict
from gyre_sched.trace import iter_trace, read_trace
from gyre_train.loss import LossConfig
from gyre_train.replay import replay_batch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

pytestmark = pytest.mark.slow


def _run(config: str | None, run_dir: Path, *sets: str, timeout: float = 900) -> dict:
    argv = [sys.executable, "-m", "gyre.cli"]
    argv += ["run", str(CONFIGS / config)] if config else ["demo"]
    argv += ["--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]


def _check_common(run_dir: Path, steps: int) -> dict:
    """What every run must leave: trace recomputing the policy's own counters, steps, final weights, replay."""
    state = json.loads((run_dir / "metrics" / "scheduler.json").read_text())
    trace = read_trace(run_dir / "trace.jsonl")
    assert (trace.d, trace.p, trace.f, trace.x) == (state["d"], state["p"], state["f"], state["x"])
    assert trace.staleness == state["staleness"]
    assert trace.steps == state["version"] >= steps
    # The end is traced when it happens: the executions it cut off are exactly those the trace left running (launched,
    # never terminated) and queued (dispatched, neither launched nor withdrawn).
    lines = list(iter_trace(run_dir / "trace.jsonl"))
    end = lines[-1]
    assert end["ev"] == "run_end" and end["steps"] == state["version"], end
    launched = [x["execution"] for x in lines if x["ev"] == "launch"]
    ended = {x["execution"] for x in lines if x["ev"] in ("terminate", "withdraw")}
    dispatched = [e for x in lines if x["ev"] == "dispatch" for e in x["executions"]]
    assert sorted(end["cancelled"]) == sorted(e for e in launched if e not in ended)
    assert sorted(end["withdrawn"]) == sorted(e for e in dispatched if e not in ended and e not in launched)
    assert trace.cut_off_at_end == end["cancelled"]
    rows = _steps(run_dir)
    assert [r["policy_version"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["num_microsteps"] >= 2 for r in rows), [r["num_microsteps"] for r in rows]
    # Several model calls per execution (the agent uses tools), recorded by the proxy.
    logs = list((run_dir / "records").glob("*.jsonl")) or list((run_dir / "records").rglob("*.log"))
    assert logs
    # The final version is published and saved.
    final = run_dir / "checkpoints" / f"policy-v{state['version']}" / "config.json"
    assert final.exists()
    assert (run_dir / "checkpoints" / "trainer").exists()
    publishes = [json.loads(x) for x in (run_dir / "metrics" / "publish.jsonl").read_text().splitlines()]
    assert publishes[-1]["version"] == state["version"]
    # The real trace replays in the simulator.
    prediction = predict(run_dir / "trace.jsonl")
    assert prediction.total_s > 0
    return state


def test_elastic_three_cells_join_mid_batch_and_match_the_reference(tmp_path):
    run_dir = tmp_path / "run"
    _run(
        "elastic-k3.toml",
        run_dir,
        "train.dtype=float64",
        "debug.dump_batches=[0,1,2,3]",
        "debug.hold_core_for_join=1",
    )
    _check_common(run_dir, 4)
    rows = _steps(run_dir)
    multi = [r for r in rows if len([c for c, n in r["microsteps_by_cell"].items() if n > 0]) >= 2]
    assert multi, [r["microsteps_by_cell"] for r in rows]
    # A satellite's first claim of a batch comes after the core's first claim of that batch (it joined mid-batch).
    claims = [line for line in iter_trace(run_dir / "trace.jsonl") if line["ev"] == "microstep_claim"]
    joined_mid = {
        c["batch"]
        for c in claims
        if c["cell"] > 0
        and any(o["cell"] == 0 and o["batch"] == c["batch"] and o["t"] <= c["t"] for o in claims)
    }
    assert joined_mid
    # That step's loss and gradient equal the single-cell reference on the same batch.
    batch = min(joined_mid)
    dump = run_dir / "metrics" / "batches" / f"batch-{batch}"
    loss, grads = replay_batch(
        dump, str(run_dir / "model"), dtype="float64", loss=LossConfig(), temperature=1.0
    )
    summed = torch.load(dump / "summed_grads.pt")
    assert loss == pytest.approx(rows[batch]["loss"], abs=1e-6)
    assert torch.allclose(grads, summed, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("config", "steps", "sets"),
    [
        ("async.toml", 3, []),
        ("colocate.toml", 3, []),
        ("colocate-standalone.toml", 3, []),
        ("demo.toml", 2, ["scheduler.k_spare=1"]),
        ("async.toml", 2, ["scheduler.dispatch=continuous"]),
    ],
    ids=["async-2+1", "colocate-phi0", "colocate-phi0.5-standalone", "oversampling", "continuous"],
)
def test_every_policy_runs_for_real(tmp_path, config, steps, sets):
    run_dir = tmp_path / "run"
    _run(config, run_dir, f"train.steps={steps}", *sets)
    state = _check_common(run_dir, steps)
    trace = read_trace(run_dir / "trace.jsonl")
    if config == "async.toml":  # the fixed split: cells 0 and 1 train, cell 2 never leaves rollout
        assert all(role == "rollout" for _, _, role in trace.roles[2])
        assert any(role == "training" for _, _, role in trace.roles[1])
    if "k_spare=1" in sets:
        assert state["cancelled_surplus"] + state["withdrawn_surplus"] > 0
    if config == "colocate-standalone.toml":
        launches = [x for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] == "launch"]
        assert any(x["engine"] == "standalone" for x in launches)


def _descendants_alive(marker: str) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            alive.append(int(entry.name))
    return alive


def test_sigterm_stops_every_process_with_one_line(tmp_path, wait_gone):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre.cli", "demo", "--run-dir", str(run_dir), "--steps", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    trace = run_dir / "trace.jsonl"
    deadline = time.monotonic() + 600
    while not (trace.exists() and b'"ev":"launch"' in trace.read_bytes()):  # gate: executions are running
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.2)
    children = _descendants_alive(str(run_dir))
    assert len(children) >= 3  # cells and proxy at least
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "interrupted by SIGTERM" in last
    wait_gone(children, "the run's processes after its SIGTERM")  # the gate: their exits
    assert _descendants_alive(str(run_dir)) == [], [
        os.readlink(f"/proc/{p}/exe") for p in _descendants_alive(str(run_dir))
    ]
