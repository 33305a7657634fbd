"""The SWE suite (tasks/swe): >= 10 repositories with failing tests, scored by gyre-eval's executable check in its
sandbox as the fraction of hidden tests that pass. Reference solutions score 1.0, starting repos less than 1, and a
solution that edits the tests (or plants its own copy of the hidden ones) scores 0."""

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from gyre.datasets import evaluator_config, load_tasks, setup_workspace
from gyre_eval.evaluator import EvaluationRequest
from gyre_eval.exec_check import ExecCheckConfig, ExecutableCheck

SUITE = Path(__file__).resolve().parents[1] / "tasks" / "swe"
TASKS = load_tasks(SUITE / "tasks.jsonl")


def _score(task, workspace: Path) -> float:
    check = ExecutableCheck(ExecCheckConfig.model_validate(evaluator_config(task)))
    req = EvaluationRequest(
        task.query_id, workspace, "final", "main", time.time() + 120, {"prompt": task.prompt}
    )
    return asyncio.run(check.evaluate(req)).score


def test_the_suite_is_a_valid_task_file():
    assert len(TASKS) >= 10 and len({t.query_id for t in TASKS}) == len(TASKS)
    for t in TASKS:
        assert t.scoring.kind == "exec" and Path(t.scoring.files).is_dir()
        # hidden tests outside the workspace
        assert not Path(t.scoring.files).is_relative_to(Path(t.workspace.dir))
        assert t.harness_timeout_s <= t.overall_budget_s


@pytest.mark.parametrize("task", TASKS, ids=[t.query_id for t in TASKS])
def test_reference_scores_one_start_below_one_tampering_zero(task, tmp_path):
    name = task.query_id.removeprefix("swe-")
    start = setup_workspace(task, tmp_path / "start")
    s0 = _score(task, start)
    assert 0.0 <= s0 < 1.0

    solved = setup_workspace(task, tmp_path / "solved")
    shutil.copytree(SUITE / "solutions" / name, solved, dirs_exist_ok=True)
    assert _score(task, solved) == 1.0

    # the reference fix, plus the repo's tests "edited" to pass: tampering scores 0
    edited = setup_workspace(task, tmp_path / "edited")
    shutil.copytree(SUITE / "solutions" / name, edited, dirs_exist_ok=True)
    test_file = edited / "tests" / f"test_{name}.py"
    test_file.write_text(test_file.read_text() + "\n# skip the hard ones\n")
    assert _score(task, edited) == 0.0

    # a planted copy of the hidden tests that always passes: 0
    planted = setup_workspace(task, tmp_path / "planted")
    (planted / "_hidden_tests").mkdir()
    (planted / "_hidden_tests" / "test_hidden.py").write_text(
        "import unittest\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    )
    assert _score(task, planted) == 0.0
