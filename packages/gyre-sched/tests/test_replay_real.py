"""A trace recorded by a real run replays in the simulator.

data/demo_run_trace.jsonl is the whole trace.jsonl of `uv run gyre demo` (K=2 CPU cells, N=4, B=2, phi=0.5, mu=1,
3 steps, 48 executions, 8 of them rerouted when a cell switched to training; ~11 kB, not trimmed). Its executions
last 1.4-4 s, rerouted ones ~2 s: less than the simulator's default reroute penalty (then 5 s), which the replay used to
subtract from each rerouted execution's recorded duration, giving negative durations ("time went backwards").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_sched.config import SimConfig
from gyre_sched.sim import Simulator
from gyre_sched.trace import iter_trace, read_trace
from gyre_sched.workload import ExecPlan, TraceWorkload

REAL = Path(__file__).parent / "data" / "demo_run_trace.jsonl"


def recorded(path: Path) -> tuple[dict[str, float], dict[str, int], list[list[str]]]:
    launch, durations, reroutes, groups = {}, {}, {}, []
    for x in iter_trace(path):
        if x["ev"] == "dispatch":
            groups.append(x["executions"])
        elif x["ev"] == "launch":
            launch[x["execution"]] = x["t"]
        elif x["ev"] == "terminate":
            durations[x["execution"]] = x["t"] - launch[x["execution"]]
        elif x["ev"] == "route":
            reroutes[x["execution"]] = reroutes.get(x["execution"], 0) + 1
    return durations, reroutes, groups


def replay_cfg(path: Path, **policy) -> SimConfig:
    h = next(iter_trace(path))
    return SimConfig.model_validate(
        {
            "steps": 9,
            "policy": {
                "N": h["N"],
                "B": h["B"],
                "phi": h["phi"],
                "mu": h["mu"],
                "async_train_cells": 1,
                **policy,
            },
            "cluster": {"nodes": h["K"], "nodes_per_cell": 1, "slots_per_node": h["C_e"]},
            "workload": {"trace": str(path), "harness_timeout_s": 120.0, "overall_budget_s": 300.0},
        }
    )


def test_the_recording_holds_the_crash_condition():
    durations, reroutes, _ = recorded(REAL)
    assert next(iter_trace(REAL))["real"] is True
    default = replay_cfg(REAL).costs().reroute_penalty_s  # the penalty the replay below charges by default
    # 15.25 s: re-prefilling 100k tokens of context on one node of the default (122B) model
    assert default > 5.0
    assert reroutes and all(durations[e] < default for e in reroutes)


def test_replayed_durations_are_the_recorded_ones():
    durations, reroutes, groups = recorded(REAL)
    wl = TraceWorkload(REAL)
    assert len(wl.groups) == len(groups)
    for n, ids in enumerate(groups):
        for i, eid in enumerate(ids):
            plan = wl.plan(n, i)
            assert plan.duration_s == pytest.approx(durations[eid], abs=1e-9)  # measured, never adjusted
            assert plan.reroutes == reroutes.get(eid, 0) and plan.assess_delay_s >= 0


@pytest.mark.parametrize(
    ("policy", "penalty"),
    [
        ({"kind": "elastic"}, None),  # the default penalty (derived, 15.25 s): crashed before
        ({"kind": "elastic", "mu": 2}, 20.0),  # the nl2repo preset's penalty
        ({"kind": "colocate", "phi": 0.0}, None),
        ({"kind": "async", "phi": 1.0}, None),
    ],
)
def test_real_trace_replays_with_any_reroute_penalty(policy, penalty):
    cfg = replay_cfg(REAL, **policy)
    if penalty is not None:
        cfg = cfg.model_copy(update={"cost": cfg.cost.model_copy(update={"reroute_penalty_s": penalty})})
    res = Simulator(cfg, deep_checks=True).run()
    assert res.steps == cfg.steps  # the recorded groups cycle: 9 steps from a 3-step recording
    assert res.counters["f"] <= res.counters["p"]


def test_recorded_reroutes_are_not_charged_twice(small, tmp_path):
    """A simulated recording's rerouted executions carry the simulator's penalty in their durations: replayed on
    the same config, every execution terminates exactly when it did in the recording."""
    cfg = small("elastic", 0.5, 3, bursts=3, workload={"query_sigma": 0.8}, cost={"reroute_penalty_s": 300.0})
    rec, rep = tmp_path / "recorded.jsonl", tmp_path / "replayed.jsonl"
    with rec.open("wb") as fh:
        res = Simulator(cfg, trace_stream=fh).run()
    replay = cfg.model_copy(update={"workload": cfg.workload.model_copy(update={"trace": str(rec)})})
    with rep.open("wb") as fh:
        again = Simulator(replay, trace_stream=fh).run()

    def ends(path: Path) -> dict[str, float]:
        return {x["execution"]: x["t"] for x in iter_trace(path) if x["ev"] == "terminate"}

    rerouted = {x["execution"] for x in iter_trace(rec) if x["ev"] == "route"}
    assert rerouted  # the recording holds reroutes
    recorded_ends, replayed_ends = ends(rec), ends(rep)  # (still running at the recording's end: censored)
    assert {e: replayed_ends[e] for e in recorded_ends} == pytest.approx(recorded_ends)
    assert again.end_time_s == pytest.approx(res.end_time_s) and again.staleness == res.staleness


def test_invalid_plans_are_refused_where_they_are_made():
    with pytest.raises(ValueError, match="duration_s=-1"):
        ExecPlan(-1.0, "completed", 0.0, "valid")
    with pytest.raises(ValueError, match=r"assess_delay_s=-0\.5"):
        ExecPlan(1.0, "completed", -0.5, "valid")


def test_cli_simulate_replays_the_real_trace_with_defaults(tmp_path, capsys):
    from gyre_sched.cli import main

    sets = [
        f"workload.trace={json.dumps(str(REAL))}",
        "cluster.nodes=2",
        "cluster.nodes_per_cell=1",
        "cluster.slots_per_node=4",
        "policy.N=4",
        "policy.B=2",
        "policy.mu=1",
        "steps=3",
    ]
    argv = ["simulate", "-", "--out", str(tmp_path), *(x for s in sets for x in ("--set", s))]
    assert main(argv) == 0, capsys.readouterr().err
    assert read_trace(tmp_path / "trace.jsonl").steps == 3
    assert (tmp_path / "roles.png").stat().st_size > 0
