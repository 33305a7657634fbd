"""Every recipe in examples/ runs as its README says, in a quick mode: its own config.toml through `gyre run`, with
a tiny local Hugging Face model built offline as `[model] path`, one step, one cell and groups of two (`--set`).
Each test reads what the run recorded: the reward of every assessed execution equals the example's own rule applied
to that execution's answer, the proxy recorded the harness's calls, the judge or the Python evaluator was called.
The two-host Ray recipe is only loaded and validated here (the two-host run itself: tests/test_launch_ray.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.config import load_config
from gyre.datasets import load_tasks
from gyre_eval.testing import JudgeRequest, ScriptedJudge, judgement

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
QUICK = ("cluster.cells=1", "scheduler.N=2", "dashboard.enabled=false", "metrics.tensorboard=false")
"""The quick mode: one cell, groups of two executions (with `--steps 1`)."""


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A local Hugging Face checkpoint folder, as `[model] path` takes one (a seeded random-init Qwen3)."""
    from gyre_cell.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


def _run(example: str, run_dir: Path, model: Path, *sets: str, env: dict | None = None) -> dict:
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(EXAMPLES / example / "config.toml"),
        "--run-dir",
        str(run_dir),
        "--steps",
        "1",
        "--quiet",
        "--set",
        f"model.path={model}",
    ]
    for s in (*QUICK, *sets):
        argv += ["--set", s]
    # The timeout only bounds a hang; nothing here measures time.
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1
    return summary


def _assessed(run_dir: Path) -> dict[str, dict]:
    """The final reward assessment of every execution assessed before the run ended, by execution id."""
    con = sqlite3.connect(run_dir / "assessments.sqlite")
    con.row_factory = sqlite3.Row
    rows = con.execute("SELECT * FROM assessments WHERE designated = 1 AND final = 1").fetchall()
    con.close()
    out = {r["execution_id"]: dict(r) | {"provenance": json.loads(r["provenance"])} for r in rows}
    assert len(out) >= 4, out  # the step's two groups of two at least
    return out


def _answer(run_dir: Path, execution_id: str) -> str:
    path = run_dir / "workspaces" / execution_id / "answer.txt"
    return path.read_text() if path.exists() else ""


def _tasks(example: str) -> dict[str, dict]:
    lines = (EXAMPLES / example / "tasks.jsonl").read_text().splitlines()
    return {f"task-{t['query_id']}": t for t in map(json.loads, lines)}


def _calls(run_dir: Path, execution_id: str) -> list[dict]:
    log = run_dir / "records" / "records" / f"{execution_id}.tito.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _check_scores(run_dir: Path, rows: dict[str, dict], tasks: dict[str, dict]) -> dict[str, float]:
    """The local-model-qa check's rule (examples/local-model-qa/check/check.py), recomputed here."""
    check = _module(EXAMPLES / "local-model-qa" / "check" / "check.py")
    scores = {}
    for eid, row in rows.items():
        answer = _answer(run_dir, eid)
        expected = tasks[row["evaluator"]]["scoring"]["command"][-1]
        assert row["status"] == "valid", (eid, row)
        want = check.score(answer, expected) if answer.strip() else 0.0
        assert row["score"] == pytest.approx(want, abs=1e-9), (eid, answer, expected)
        scores[eid] = row["score"]
    return scores


@pytest.mark.slow
def test_local_model_qa(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    summary = _run("local-model-qa", run_dir, tiny_model)
    rows = _assessed(run_dir)
    tasks = _tasks("local-model-qa")
    assert {r["evaluator"] for r in rows.values()} <= set(tasks)
    scores = _check_scores(run_dir, rows, tasks)
    assert all(r["provenance"]["kind"] == "exec" for r in rows.values())
    # The policy is the given folder, and the proxy recorded each assessed execution's calls.
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["path"] == str(tiny_model)
    assert all(_calls(run_dir, eid) for eid in rows)
    step = json.loads((run_dir / "metrics" / "steps.jsonl").read_text().splitlines()[0])
    assert 0.0 <= step["mean_reward"] <= 1.0 and summary["mean_reward_per_step"] == [step["mean_reward"]]
    assert all(0.0 <= v <= 1.0 for v in scores.values())


@pytest.mark.slow
def test_command_harness(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    env = os.environ | {"PATH": f"{EXAMPLES / 'command-harness'}:{os.environ['PATH']}"}
    _run("command-harness", run_dir, tiny_model, env=env)
    rows = _assessed(run_dir)
    _check_scores(run_dir, rows, _tasks("local-model-qa"))
    for eid in rows:
        # qa-agent's two calls, recorded by the proxy: the question, then the check with its first reply in it
        calls = _calls(run_dir, eid)
        if (run_dir / "workspaces" / eid / "answer.txt").exists():  # written after its second call
            assert len(calls) == 2, (eid, len(calls))
            assert all(c["execution_id"] == eid for c in calls)
            assert calls[1]["metadata"]["sampling"]["used"]["temperature"] == 1.0
    assert any((run_dir / "workspaces" / eid / "answer.txt").exists() for eid in rows)


@pytest.mark.slow
def test_judge_reward(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    tasks = _tasks("judge-reward")

    def share(answer: str) -> float:  # the scripted judge's rule: the share of the reply's letters a-m
        text = answer.strip().lower()
        return round(sum("a" <= c <= "m" for c in text) / len(text), 6) if text else 0.0

    def reply(req: JudgeRequest) -> str:
        return judgement(share(req.files().get("answer.txt", "")), "share of letters a-m")

    with ScriptedJudge(reply, api_key="judge-secret") as judge:
        env = os.environ | {"JUDGE_API_KEY": "judge-secret"}
        _run(
            "judge-reward",
            run_dir,
            tiny_model,
            f"judge.base_url={judge.base_url}",
            "judge.model=scripted-judge",
            env=env,
        )
        requests = list(judge.requests)
    rows = _assessed(run_dir)
    for eid, row in rows.items():
        assert row["status"] == "valid", (eid, row)
        answer = _answer(run_dir, eid)
        # a reply with a NUL byte is shown to the judge as a binary file, without its text
        shown = "" if "\0" in answer else answer
        assert row["score"] == pytest.approx(share(shown), abs=1e-9), (eid, answer)
        assert row["provenance"]["kind"] == "judge"
        assert row["provenance"]["describe"]["model"] == "scripted-judge"
    # The judge was asked with each assessed task's own rubric, and the key never reached the run directory.
    asked = {r.rubric for r in requests}
    assert {tasks[r["evaluator"]]["scoring"]["rubric"] for r in rows.values()} <= asked
    assert len(requests) >= len(rows) and {r.model for r in requests} == {"scripted-judge"}
    assert "judge-secret" not in (run_dir / "config.json").read_text()


@pytest.mark.slow
def test_python_evaluator(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    folder = EXAMPLES / "python-evaluator"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    }
    _run("python-evaluator", run_dir, tiny_model, env=env)
    rows = _assessed(run_dir)
    tasks = _tasks("python-evaluator")
    reward = _module(folder / "number_reward.py")
    for eid, row in rows.items():
        expected = tasks[row["evaluator"]]["scoring"]["options"]["expected"]
        assert row["status"] == "valid", (eid, row)
        # the evaluator itself scored it: its kind and description are the assessment's provenance
        assert row["provenance"]["kind"] == "number-closeness"
        assert row["provenance"]["describe"]["expected"] == expected
        want = reward.closeness(_answer(run_dir, eid), expected)
        assert row["score"] == pytest.approx(want, abs=1e-9), (eid, _answer(run_dir, eid))


def test_two_host_ray_config_loads_and_validates():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre.cli",
            "config",
            "--config",
            str(EXAMPLES / "two-host-ray" / "config.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith('kind = "ray"') and line.endswith("# file") for line in lines), lines
    assert any(line.startswith("address = ") and line.endswith("# file") for line in lines)


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()))
def test_every_example_has_a_valid_config_and_task_file(example):
    folder = EXAMPLES / example
    assert (folder / "README.md").is_file()
    cfg = load_config(folder / "config.toml")  # ConfigError names the field of anything invalid
    if cfg.tasks.file is not None:  # relative to the repository root, where the READMEs run it
        assert load_tasks(ROOT / cfg.tasks.file)
