"""Built-in evaluators: the executable check and the rubric judge (against a real HTTP judge on loopback)."""

import time

import pytest
from eval_helpers import JUDGE_KEY, judge_app, run, serve_in_thread

from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest
from gyre_eval.exec_check import ExecCheckConfig, ExecutableCheck, parse_score
from gyre_eval.judge import Judge, JudgeConfig, parse_judgement, render_workspace
from gyre_eval.sandbox import SandboxConfig


def _request(workspace, deadline_s=30.0, **kw) -> EvaluationRequest:
    return EvaluationRequest(
        execution_id="e1",
        workspace=workspace,
        artifact_version="v1",
        branch="main",
        deadline=time.time() + deadline_s,
        **kw,
    )


def _check(command, **kw) -> ExecutableCheck:
    return ExecutableCheck(ExecCheckConfig(command=command, sandbox=SandboxConfig(timeout_s=5), **kw))


def test_exit_code_scores_pass_one_and_fail_a_valid_zero(workspace):
    assert run(_check(["bash", "-c", "grep -q hello main.py"]).evaluate(_request(workspace))).score == 1.0
    verdict = run(_check(["bash", "-c", "grep -q absent main.py"]).evaluate(_request(workspace)))
    assert verdict.score == 0.0  # the check ran and the artifact failed: a valid zero
    assert verdict.details["returncode"] == 1


@pytest.mark.parametrize(
    "command, needle",
    [
        (["bash", "-c", "kill -SEGV $$"], "signal 11"),  # crash
        (["bash", "-c", "exit 7"], "neither a pass nor a fail code"),
        (["sleep", "30"], "timed out"),  # hang
        (["no-such-binary-xyz"], "could not start"),
    ],
)
def test_check_failures_raise_instead_of_scoring(workspace, command, needle):
    check = ExecutableCheck(ExecCheckConfig(command=command, sandbox=SandboxConfig(timeout_s=0.5)))
    with pytest.raises(EvaluatorError, match=needle):
        run(check.evaluate(_request(workspace)))


def test_score_file_mode(workspace):
    check = _check(["bash", "-c", 'echo \'{"score": 0.625}\' > "$GYRE_SCORE_FILE"'], score_from="score_file")
    assert run(check.evaluate(_request(workspace))).score == 0.625
    silent = _check(["true"], score_from="score_file")
    with pytest.raises(EvaluatorError, match="without writing"):
        run(silent.evaluate(_request(workspace)))
    garbled = _check(["bash", "-c", 'echo nan-ish > "$GYRE_SCORE_FILE"'], score_from="score_file")
    with pytest.raises(EvaluatorError, match="not a number"):
        run(garbled.evaluate(_request(workspace)))


def test_parse_score_rejects_non_finite_and_non_numbers():
    assert parse_score("0.5\n") == 0.5 and parse_score('{"score": 1}') == 1.0
    for bad in ("NaN", "true", '"0.5"', '{"points": 1}', "Infinity"):
        with pytest.raises(EvaluatorError):
            parse_score(bad)


def test_pass_and_fail_codes_must_be_disjoint():
    with pytest.raises(ValueError, match="both pass and fail"):
        ExecCheckConfig(command=["true"], pass_codes=[0, 1], fail_codes=[1])


# -- judge -----------------------------------------------------------------------------------------------------------


async def _judge_once(judge: Judge, request: EvaluationRequest):
    """Evaluate and close in one event loop (the judge's HTTP client belongs to the loop that used it)."""
    try:
        return await judge.evaluate(request)
    finally:
        await judge.aclose()


def _judge(url: str) -> Judge:
    return Judge(
        JudgeConfig(
            base_url=url + "/v1", model="judge-model", rubric="Does it print hello?", api_key=JUDGE_KEY
        )
    )


def test_judge_scores_against_the_rubric_with_its_own_credential(workspace):
    app = judge_app()
    with serve_in_thread(app) as url:
        judge = _judge(url)
        verdict = run(_judge_once(judge, _request(workspace, task={"prompt": "Write a hello program"})))
    assert verdict.score == 0.75
    assert verdict.critique == "prints hello; no tests"
    assert verdict.details["judge_model"] == "judge-model" and verdict.details["response_id"] == "chatcmpl-1"
    (seen,) = app.state.requests
    assert seen["auth"] == f"Bearer {JUDGE_KEY}"
    prompt = seen["body"]["messages"][-1]["content"]
    assert "Does it print hello?" in prompt and "Write a hello program" in prompt
    assert "## main.py\nprint('hello')" in prompt
    assert seen["body"]["temperature"] == 0.0
    assert JUDGE_KEY not in str(judge.describe())


@pytest.mark.parametrize(
    "reply, needle",
    [
        ((500, ""), "HTTP 500"),
        ((200, "I think it is fine."), "no JSON object"),
        ((200, '{"score": 7}'), "outside"),
        ((200, '{"critique": "no score"}'), "no numeric score"),
    ],
)
def test_judge_failures_raise(workspace, reply, needle):
    with serve_in_thread(judge_app([reply])) as url:
        judge = _judge(url)
        with pytest.raises(EvaluatorError, match=needle):
            run(_judge_once(judge, _request(workspace)))


def test_judge_unreachable_is_a_failure(workspace):
    judge = _judge("http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(EvaluatorError, match="request failed"):
        run(_judge_once(judge, _request(workspace)))


def test_parse_judgement_accepts_prose_around_json():
    assert parse_judgement('Sure. {"score": 0, "critique": "empty"} Done.') == (0.0, "empty")


def test_render_workspace_skips_symlinks_and_truncates(tmp_path, workspace):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    (workspace / "leak").symlink_to(secret)
    (workspace / "blob.bin").write_bytes(b"\0\1\2")
    text = render_workspace(workspace, 10_000)
    assert "TOP SECRET" not in text and "blob.bin (binary, 3 bytes)" in text
    assert "truncated" in render_workspace(workspace, 40)
