"""What `gyre run --resume RUN` reads from an interrupted run directory (gyre.run.resume.find_resume_point), without
running anything: the settlement of unfinished work, untrained groups carried over (ready or open), a step checkpointed but never traced,
torn last lines, and the one-line refusals of the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gyre.config import load_config
from gyre.run.resume import ResumeError, find_resume_point
from gyre_eval.store import AssessmentStore
from gyre_eval.types import Provenance, Submission
from gyre_sched.config import PolicyParams
from gyre_sched.policies import make_policy
from gyre_sched.trace import TraceWriter, read_trace

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(run: Path, version: int, groups: list[str]) -> None:
    step = run / "checkpoints" / "trainer" / f"step-{version}"
    (step / "hf").mkdir(parents=True)
    (step / "hf" / "config.json").write_text("{}")
    (step / "meta.json").write_text(json.dumps({"version": version}))
    report = {"policy_version": version, "group_ids": groups, "staleness": [0] * len(groups)}
    (step / "report.json").write_text(json.dumps(report))


def _interrupted_run(tmp_path: Path) -> Path:
    """Steps 1 and 2 done and checkpointed; step 2 recorded in steps.jsonl only (the trace never got it); g2 and
    g3 dispatched after: g2.e0 running, g2.e1 finished, g3 queued; a torn last trace line."""
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    cfg = load_config(None, {"run_dir": str(run), "train.steps": 4})
    (run / "config.json").write_text(cfg.model_dump_json())
    with (run / "trace.jsonl").open("wb") as f:
        w = TraceWriter(f, {"K": 2, "C_e": 2, "C_s": 0, "N": 2, "B": 1, "phi": 0, "mu": 1})
        for g in ("g0", "g1", "g2", "g3"):
            w.write(1.0, "dispatch", group=g, executions=[f"{g}.e0", f"{g}.e1"], v_d=0)
        for e in ("g0.e0", "g0.e1", "g1.e0", "g1.e1", "g2.e0", "g2.e1"):
            w.write(2.0, "launch", execution=e)
        for e in ("g0.e0", "g0.e1", "g1.e0", "g1.e1", "g2.e1"):
            w.write(3.0, "terminate", execution=e, outcome="completed")
        w.write(4.0, "step_end", version=1, groups=["g0"], staleness=[0])
        f.write(b'{"t":5.0,"ev":"launch","exec')  # torn by the kill
    rows = [{"policy_version": v, "group_ids": [g], "staleness": [0]} for v, g in ((1, "g0"), (2, "g1"))]
    (run / "metrics" / "steps.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    _checkpoint(run, 1, ["g0"])
    _checkpoint(run, 2, ["g1"])
    return run


def test_unfinished_work_is_settled_and_the_untraced_step_recorded(tmp_path):
    run = _interrupted_run(tmp_path)
    point = find_resume_point(run)
    assert (point.version, point.next_group, point.cfg.train.steps) == (2, 4, 4)
    assert point.checkpoint == run / "checkpoints" / "trainer" / "step-2"
    assert (point.cancelled, point.withdrawn) == (["g2.e0"], ["g3.e0", "g3.e1"])
    assert point.dropped_groups == ["g2", "g3"]  # g0 and g1 were trained (g1 known from steps.jsonl only)
    assert [r["policy_version"] for r in point.untraced_steps] == [2]
    # The continued trace: torn line cut, the missing step_end, then the resume line; counters settle to w = 0.
    point.trace(["rollout", "rollout"]).close()
    lines = [orjson.loads(x) for x in (run / "trace.jsonl").read_bytes().splitlines()]
    assert [x["ev"] for x in lines[-2:]] == ["step_end", "resume"]
    s = read_trace(run / "trace.jsonl")
    assert s.steps == 2 and (s.d, s.p, s.f, s.x) == (8, 6, 6, 2) and s.d - s.x - s.f == 0
    assert point.before == {"d": 8, "p": 6, "f": 6, "x": 2}


def test_a_step_checkpointed_but_not_recorded_is_appended_to_the_metrics(tmp_path):
    run = _interrupted_run(tmp_path)
    _checkpoint(run, 3, ["g2"])  # killed between the checkpoint and the controller's record
    point = find_resume_point(run)
    assert point.version == 3 and "g2" not in point.dropped_groups
    rows = [json.loads(x) for x in (run / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3] and rows[-1]["recorded_on_resume"]


def test_runs_that_cannot_be_resumed_are_refused(tmp_path):
    with pytest.raises(ResumeError, match="no run to resume"):
        find_resume_point(tmp_path)
    run = _interrupted_run(tmp_path)
    for step in (run / "checkpoints" / "trainer").iterdir():
        (step / "meta.json").unlink()  # incomplete checkpoints are no checkpoints
    with pytest.raises(ResumeError, match="no step checkpoint"):
        find_resume_point(run)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["run", "--resume", "/nonexistent/run"],
            "gyre run: cannot resume: /nonexistent/run holds no run to resume",
        ),
        (["run", "configs/demo.toml", "--resume", "x"], "gyre run: --resume takes the run's own config"),
        (["run"], "gyre run: a config file is needed (or --resume RUN_DIR)"),
    ],
)
def test_cli_refuses_with_one_line(args, line):
    out = subprocess.run([sys.executable, "-m", "gyre.cli", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2
    (only,) = out.stderr.strip().splitlines()
    assert only.startswith(line)


def _assess(store, eid: str, status: str, score: float) -> None:
    gid, index = eid.split(".")
    sub = Submission(
        execution_id=eid,
        group_id=gid,
        group_size=2,
        group_dispatched=3,
        dispatch_index=int(index[1:]),
        launched_at=1.0,
        budget_s=60.0,
    )
    store.submit(sub, status, score, True, Provenance(evaluator="task", kind="exec"), 2.0)


def test_untrained_groups_with_usable_executions_are_carried_over_ready_or_open(tmp_path):
    """g4 ready with its assessments and trajectories: carried ready (statuses, scores, paths, its v_d). g5 ready but
    a valid member's trajectories are gone, g6 ready but a member's assessment is not in the store: that member is
    excluded, and each is carried open. g7 had an excluded execution, so its spare g7.e2 counts in its place. g8 was
    open: g8.e0's assessment landed in the store after the trace's last line, g8.e1 was running (cancelled, whatever
    the store says): open.
    A second resume of the resumed run continues the carried groups' numbering."""
    run = _interrupted_run(tmp_path)
    store = AssessmentStore(run)
    (run / "trajectories").mkdir()
    data = (run / "trace.jsonl").read_bytes()
    keep, torn = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1 :]
    (run / "trace.jsonl").write_bytes(keep)  # the torn line stays the last one
    with (run / "trace.jsonl").open("ab") as f:
        w = TraceWriter.append_to(f)
        for g, n in (("g4", 2), ("g5", 2), ("g6", 2), ("g7", 3)):
            execs = [f"{g}.e{i}" for i in range(n)]
            w.write(6.0, "dispatch", group=g, query=f"q{g[1:]}", executions=execs, v_d=1)
            for e in execs:
                status = "excluded" if e == "g7.e1" else "no_work" if e == "g4.e1" else "valid"
                w.write(7.0, "launch", execution=e)
                w.write(8.0, "terminate", execution=e, outcome="completed")
                w.write(9.0, "assessed", execution=e, status=status)
                if status != "excluded" and e != "g6.e1":
                    _assess(store, e, status, 0.0 if status == "no_work" else 0.25)
                if status == "valid" and e != "g5.e0":
                    (run / "trajectories" / f"{e}.parquet").write_bytes(b"PAR1")
            w.write(9.5, "group_ready", group=g)
        w.write(9.6, "dispatch", group="g8", query="q8", executions=["g8.e0", "g8.e1"], v_d=2)
        for e in ("g8.e0", "g8.e1"):
            w.write(9.7, "launch", execution=e)
        w.write(9.8, "terminate", execution="g8.e0", outcome="completed")
        for e in ("g8.e0", "g8.e1"):  # g8.e1's too, though the trace never saw it end: the kill cancels it
            _assess(store, e, "valid", 0.5)
            (run / "trajectories" / f"{e}.parquet").write_bytes(b"PAR1")
        f.write(torn)
    store.close()
    point = find_resume_point(run)
    assert [g.group for g in point.carried] == ["g4", "g5", "g6", "g7", "g8"]
    g4, g5, g6, g7, g8 = point.carried
    assert (g4.query, g4.v_d, g4.members) == ("q4", 1, (("g4.e0", "valid"), ("g4.e1", "no_work")))
    assert g5.members == (("g5.e0", "excluded"), ("g5.e1", "valid"))
    assert g6.members == (("g6.e0", "valid"), ("g6.e1", "excluded"))
    assert g7.members == (("g7.e0", "valid"), ("g7.e1", "excluded"), ("g7.e2", "valid"))
    assert (g8.v_d, g8.members) == (2, (("g8.e0", "valid"), ("g8.e1", "excluded")))
    assert point.carried_scores == {
        "g4.e0": 0.25,
        "g4.e1": 0.0,
        "g5.e1": 0.25,
        "g6.e0": 0.25,
        "g7.e0": 0.25,
        "g7.e2": 0.25,
        "g8.e0": 0.5,
    }
    assert point.carried_paths["g4.e1"] is None and point.carried_paths["g4.e0"].endswith(
        "trajectories/g4.e0.parquet"
    )
    assert point.dropped_groups == ["g2", "g3"] and "g8.e1" in point.cancelled
    writer = point.trace(["rollout", "rollout"])
    resume = orjson.loads((run / "trace.jsonl").read_bytes().splitlines()[-1])
    assert resume["carried_groups"] == ["g4", "g5", "g6", "g7", "g8"] and resume["dropped_groups"] == [
        "g2",
        "g3",
    ]
    assert resume["carried_members"]["g5"] == [["g5.e0", "excluded"], ["g5.e1", "valid"]]
    # The resumed policy holds g4 and g7 ready and dispatches, first, the one member each open group lacks.
    params = PolicyParams(kind="elastic", K=2, C_e=2, N=2, B=1, phi=0, mu=1)  # as the trace header
    policy = point.policy(make_policy(params))
    assert [g.id for g in policy.ledger.ready_unassigned()] == ["g4", "g7"] and policy.ledger.d == 3
    start = policy.start(point.t_end)
    carried = [x for x in start if getattr(x, "carried", False)]
    assert [(x.group_id, x.execution_ids, x.v_d) for x in carried] == [
        ("g5", ("g5.e2",), 1),
        ("g6", ("g6.e2",), 1),
        ("g8", ("g8.e2",), 2),
    ]
    writer.decisions(point.t_end, start)
    writer.close()
    # Killed again before anything new finished: the carried groups are carried again, their new members excluded,
    # and an old member the first resume excluded stays excluded though its assessment landed since.
    store = AssessmentStore(run)
    _assess(store, "g6.e1", "valid", 0.75)
    (run / "trajectories" / "g6.e1.parquet").write_bytes(b"PAR1")
    store.close()
    again = find_resume_point(run)
    assert again.carried[2].members == (("g6.e0", "valid"), ("g6.e1", "excluded"), ("g6.e2", "excluded"))
    assert [g.group for g in again.carried] == ["g4", "g5", "g6", "g7", "g8"]
    assert again.carried[1].members == (("g5.e0", "excluded"), ("g5.e1", "valid"), ("g5.e2", "excluded"))
    policy = again.policy(make_policy(params))
    more = [x for x in policy.start(again.t_end) if getattr(x, "carried", False)]
    assert [x.execution_ids for x in more] == [("g5.e3",), ("g6.e3",), ("g8.e3",)]
