"""What `gyre run --resume RUN` reads from an interrupted run directory (gyre.resume.find_resume_point), without
running anything: the settlement of unfinished work, a step checkpointed but never traced, torn last lines, and the
one-line refusals of the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gyre.config import load_config
from gyre.resume import ResumeError, find_resume_point
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
