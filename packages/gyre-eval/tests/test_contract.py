"""Every evaluator passes the plug-in contract: the two built-ins and a user plug-in loaded by reference.

The contract itself must be able to fail: evaluators that break a rule are rejected with the rule's name."""

from pathlib import Path

import pytest
from eval_helpers import JUDGE_KEY, judge_app, run, serve_in_thread

from gyre_eval.config import PluginConfig, build_evaluator
from gyre_eval.contract import check_evaluator
from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest, Verdict
from gyre_eval.exec_check import ExecCheckConfig
from gyre_eval.judge import JudgeConfig
from gyre_eval.sandbox import SandboxConfig


async def _contract(evaluator, workspace, expected, secrets=()):
    try:
        return await check_evaluator(evaluator, workspace, expected_score=expected, secrets=secrets)
    finally:
        await evaluator.aclose()


def test_executable_check_passes_the_contract(workspace):
    spec = ExecCheckConfig(
        command=["bash", "-c", "grep -q hello main.py && echo scribble > main.py"],
        sandbox=SandboxConfig(timeout_s=10),
    )
    verdict = run(_contract(build_evaluator(spec), workspace, 1.0))
    assert verdict.details["sandbox"]["private_copy"] is True


def test_judge_passes_the_contract(workspace):
    with serve_in_thread(judge_app()) as url:
        spec = JudgeConfig(base_url=url + "/v1", model="m", rubric="hello?", api_key=JUDGE_KEY)
        verdict = run(_contract(build_evaluator(spec), workspace, 0.75, secrets=[JUDGE_KEY]))
    assert verdict.critique


def test_user_plugin_passes_the_contract(workspace):
    spec = PluginConfig(
        factory="eval_plugin_example:RequiredFiles", options={"required": ["main.py", "tests.py"]}
    )
    verdict = run(_contract(build_evaluator(spec), workspace, 0.5))
    assert verdict.critique == "missing: tests.py"


def test_plugin_references_are_validated():
    with pytest.raises(ValueError, match=r"package\.module:attribute"):
        build_evaluator(PluginConfig(factory="no_colon_here"))
    with pytest.raises(ValueError, match="cannot import"):
        build_evaluator(PluginConfig(factory="no_such_module_xyz:Thing"))
    with pytest.raises(ValueError, match="lacks kind/describe/evaluate/aclose"):
        build_evaluator(PluginConfig(factory="pathlib:PurePath", options={}))


class _Base:
    kind = "bad"

    def describe(self):
        return {"v": 1}

    async def aclose(self):
        return None


class Scribbler(_Base):
    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        if not request.workspace.is_dir():
            raise EvaluatorError("missing")
        (request.workspace / "main.py").write_text("overwritten")
        return Verdict(score=1.0)


class ZeroOnFailure(_Base):
    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        return Verdict(score=1.0 if request.workspace.is_dir() else 0.0)


class Leaky(_Base):
    def describe(self):
        return {"api_key": "sk-secret"}

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        raise EvaluatorError("unused")


class Flipper(_Base):
    def __init__(self):
        self.calls = 0

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        if not request.workspace.is_dir():
            raise EvaluatorError("missing")
        self.calls += 1
        return Verdict(score=float(self.calls % 2))


@pytest.mark.parametrize(
    "evaluator, needle",
    [
        (Scribbler(), "modified the preserved workspace"),
        (ZeroOnFailure(), "must raise, not score 0.0"),
        (Leaky(), "leaks a secret"),
        (Flipper(), "same state scored"),
    ],
)
def test_contract_rejects_rule_breakers(workspace: Path, evaluator, needle):
    with pytest.raises(AssertionError, match=needle):
        run(check_evaluator(evaluator, workspace, secrets=["sk-secret"]))
