"""The CLI: simulate and compare write their resolved config first, a trace, plots; bad input -> exit 2 + message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gyre_sched.cli import main
from gyre_sched.trace import read_trace

SMALL_TOML = """
name = "tiny"
steps = 6
[policy]
N = 2
B = 4
phi = 0.5
mu = 2
tau_s = 10.0
async_train_cells = 1
[cluster]
nodes = 4
nodes_per_cell = 1
slots_per_node = 6
[workload]
query_median_s = 900.0
harness_timeout_s = 3600.0
overall_budget_s = 4000.0
[cost]
train_node_s_per_group = 200.0
"""


def test_simulate_writes_config_trace_plots(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(SMALL_TOML)
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--out", str(out), "--set", "policy.streaming=false"]) == 0
    text = capsys.readouterr().out
    assert "end-to-end time" in text and "staleness mean" in text and "time share per role" in text
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["policy"]["streaming"] is False and resolved["cluster"]["nodes"] == 4
    assert read_trace(out / "trace.jsonl").steps == 6
    for png in ("roles.png", "waterlevel.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_compare_prints_speedup_table(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    raw = {
        "name": "tiny",
        "steps": 6,
        "policy": {"N": 2, "B": 4, "async_train_cells": 1},
        "cluster": {"nodes": 4, "nodes_per_cell": 1, "slots_per_node": 6},
        "workload": {"query_median_s": 900.0, "harness_timeout_s": 3600.0, "overall_budget_s": 4000.0},
        "compare": {"staleness": 1.0, "mu": {"elastic": 2, "async": 1}},
    }
    cfg.write_text(json.dumps(raw))
    assert main(["compare", str(cfg), "--out", str(tmp_path / "cmp"), "--no-plots"]) == 0
    text = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()
        for line in text.splitlines()
        if line.split()[:1] in (["elastic"], ["async"], ["colocate"])
    }
    assert set(rows) == {"elastic", "async", "colocate"}
    assert rows["colocate"][1:3] == ["0.00", "3"] and rows["async"][1:3] == ["1.00", "1"]  # eq.2 at E[d] = 1
    assert rows["elastic"][-1] == "1.00x"
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())[0]["policy"] == "elastic"


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[policy]\nphi = 0.3\nB = 32\n")
    assert main(["simulate", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "phi * B" in capsys.readouterr().err
    cfg.write_text("[policy\n")
    assert main(["simulate", str(cfg)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing.toml")]) == 2
    assert main(["simulate", "-", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    cfg.write_text("[cluster]\nnodes = 30\nnodes_per_cell = 4\n")
    assert main(["simulate", str(cfg)]) == 2
    assert "multiple of nodes_per_cell" in capsys.readouterr().err


def test_importing_gyre_sched_never_imports_torch():
    code = (
        "import sys, pkgutil, importlib, gyre_sched\n"
        "for m in pkgutil.walk_packages(gyre_sched.__path__, 'gyre_sched.'): importlib.import_module(m.name)\n"
        "import gyre_sched.plots as p; p._plt()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_recommends_within_the_target_and_plots(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(SMALL_TOML)
    out = tmp_path / "plan"
    assert main(["plan", str(cfg), "--staleness", "1.0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "plan.json").read_text())
    runs = summary["runs"]
    kinds = {(r["kind"], r["planner"]) for r in runs}
    assert {("elastic", "fixed"), ("elastic", "adaptive"), ("async", "fixed"), ("colocate", "fixed")} <= kinds
    assert {r["mu"] for r in runs if r["kind"] == "elastic"} == {1, 2, 3}  # phi = 1.0, 0.5, 0.0
    best = summary["best"]["1.0"]
    within = [r for r in runs if r["staleness"] <= 1.05]
    assert best["recommended"]["time_h"] == min(r["time_h"] for r in within)  # the fastest within the target
    assert best["bound_h"] < best["recommended"]["time_h"]
    # ideal <= capacity bound <= the dispatch-order schedule (a schedule of the same executions, free training)
    assert best["bound_h"] <= best["capacity_bound_h"] <= best["dispatch_order_h"] * (1 + 1e-9)
    assert best["over_dispatch_order"] == pytest.approx(
        best["recommended"]["time_h"] / best["dispatch_order_h"]
    )
    assert (out / "plan.png").stat().st_size > 10_000
    assert (
        "recommended at E[d]=1.0" in text
        and json.loads(text.splitlines()[-1])["1.0"]["label"] == best["label"]
    )


def test_calibrate_prints_costs_runs_and_notes(capsys):
    from pathlib import Path

    runs = sorted((Path(__file__).parent / "data" / "real_runs").iterdir())
    assert main(["calibrate", *map(str, runs)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("micro-step:") and any(x.startswith("warmup_s") for x in out)
    assert sum(x.split()[0] in {r.name for r in runs} for x in out if x.split()) == 4
    assert json.loads(out[-1])["cost"]["weight_bytes"] == 4.0
