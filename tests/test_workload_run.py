"""A `gyre run` that plays a workload definition (`gyre_sched.workload_harness`, `gyre_eval.workload`), the one the
simulator runs: every execution ends the way its plan says and its assessment takes the planned evaluator attempts.

The workload is small and busy (seed 12): group 0 holds a complete failure and three executions that reach the common
harness timeout together (a cluster of ends), group 1 a hang known by stalling and evaluations retried after drawn
failures. The harness's durations are wall time by design (it plays a workload), so where a plan ends close to a
deadline the machine's speed could decide which side it lands on: those executions are checked for either outcome,
every other one for its plan's. A complete failure, an execution that never ends by itself, a silence the stall
watchdog ends and an evaluator failure do not depend on speed at all.
"""

import json
import sqlite3
import subprocess
import sys

import pytest

from gyre.workload_tasks import workload_run_files
from gyre_sched.config import WorkloadConfig
from gyre_sched.trace import iter_trace
from gyre_sched.workload_harness import plan_of

SEED = 12
WORKLOAD = WorkloadConfig(
    query_median_s=3.0,
    query_sigma=0.3,
    exec_sigma=0.4,
    hard_query_rate=0.3,
    hard_query_factor=5.0,
    harness_timeout_s=12.0,
    overall_budget_s=16.0,
    failed_rate=0.1,
    failed_at_s=0.5,
    overall_timeout_rate=0.08,
    exclusion_known="stall",
    stall_detect_s=4.0,
    eval_latency_s=0.5,
    eval_failure_rate=0.35,
    tool_latency_s=0.3,
)
MARGIN_S = 3.0
"""How close to a deadline a planned end may be before the machine's speed could move it past: a real execution
starts later than its launch by the harness's start-up and the watchdog looks once a second."""


def _expected_outcomes(execution_id: str) -> set[str]:
    plan = plan_of(WORKLOAD, SEED, execution_id)
    timeout = WORKLOAD.harness_timeout_s
    if plan.outcome == "stalled":
        near = plan.duration_s + 1.0 + MARGIN_S >= timeout  # the watchdog's poll is at least 1 s
        return {"stalled", "harness_timeout"} if near else {"stalled"}
    if plan.outcome == "completed" and plan.duration_s + MARGIN_S >= timeout:
        return {"completed", "harness_timeout"}
    return {plan.outcome}


def test_the_plan_holds_every_tail_in_its_first_groups():
    plans = {f"g{g}.e{i}": plan_of(WORKLOAD, SEED, f"g{g}.e{i}") for g in range(2) for i in range(4)}
    assert [p.outcome for p in plans.values()][:4] == ["failed"] + ["harness_timeout"] * 3
    assert plans["g1.e0"].outcome == "stalled" and len(plans["g1.e1"].evaluation) == 2


@pytest.mark.slow
def test_a_run_plays_its_workload_definition(tmp_path):
    run_dir = tmp_path / "run"
    _, sets = workload_run_files(WORKLOAD, SEED, tmp_path / "workload")
    assert f"agent.stall_detect_s={WORKLOAD.stall_detect_s}" in sets
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--steps",
        "2",
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "scheduler.N=3",
        "--set",
        "scheduler.B=2",
        "--set",
        "scheduler.k_spare=1",
        "--set",
        "assessment.retry_wait_min_s=0",
        "--set",
        "assessment.retry_wait_max_s=0",
        "--set",
        "debug.dump_batches=[0]",
    ]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 2

    trace = list(iter_trace(run_dir / "trace.jsonl"))
    outcome = {x["execution"]: x["outcome"] for x in trace if x["ev"] == "terminate"}
    assessed = {x["execution"]: x["status"] for x in trace if x["ev"] == "assessed"}
    con = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = {r[0]: r[1:] for r in con.execute("SELECT execution_id, status, score, final FROM assessments")}
    attempts: dict[str, list[int]] = {}
    for eid, ok in con.execute(
        "SELECT a.execution_id, t.ok FROM attempts t JOIN assessments a "
        "ON a.id = t.assessment_id ORDER BY t.assessment_id, t.number"
    ):
        attempts.setdefault(eid, []).append(ok)
    con.close()

    ended = {e: o for e, o in outcome.items() if o != "cancelled"}  # cancelled: surplus spares, the run's end
    # The quick ones always end inside the run; group 0's timeouts (12 s) only if the run's two steps do not end
    # first (a loaded machine trains the faster groups before them, and the run's end cancels them).
    assert {"g0.e0", "g1.e0", "g1.e1"} <= set(ended)
    for eid, how in ended.items():
        assert how in _expected_outcomes(eid), (eid, how, plan_of(WORKLOAD, SEED, eid))
    assert {"failed", "stalled"} <= set(ended.values())
    for eid, how in ended.items():
        plan = plan_of(WORKLOAD, SEED, eid)
        if how == "failed":  # the harness could not start its agent: the placeholder
            assert assessed[eid] == "no_work" and rows[eid][:2] == ("no_work", 0.0)
        elif how == "stalled":  # excluded at its termination by the scheduler: no assessment is asked for
            assert eid not in rows and eid not in assessed
        elif eid in assessed and plan.status == "valid" and how == plan.outcome:
            # the evaluator failed where the workload drew failures, then succeeded: the planned attempts
            planned = [int(ok) for _, ok in plan.evaluation]
            assert attempts[eid] == planned and assessed[eid] == "valid", (eid, attempts[eid], plan)
    assert any(len(a) > 1 and a[-1] == 1 for a in attempts.values())  # a retried evaluation turned valid

    # Trained: no excluded execution, and the first batch's executions each with a valid score.
    dump = run_dir / "metrics" / "batches" / "batch-0" / "microsteps.jsonl"
    trained = {e["execution_id"] for line in dump.open() for e in json.loads(line)["executions"]}
    assert trained and all(rows[e][0] == "valid" for e in trained)
    assert not {e for e, how in ended.items() if how == "stalled"} & trained
