"""`gyre_eval.testing.ScriptedJudge` against the real `Judge`: it receives the judge's task, rubric and artifact
files as sent, its scripted reply is parsed into the verdict, a reply that is not JSON is the judge's error, and a
wrong key or a request that is not the judge's get OpenAI-shaped errors."""

import asyncio
import time

import httpx
import pytest

from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest
from gyre_eval.judge import Judge, JudgeConfig
from gyre_eval.testing import JudgeRequest, ScriptedJudge, judgement


def _request(ws, task="Write a haiku.") -> EvaluationRequest:
    return EvaluationRequest(
        execution_id="e1",
        workspace=ws,
        artifact_version="v1",
        branch="main",
        deadline=time.time() + 30,
        task={"prompt": task},
    )


def _score(req: JudgeRequest) -> str:
    if "BROKEN" in req.rubric:
        return "I'd say about 0.7 {score: 0.7}"
    answer = req.files().get("answer.txt", "")
    return judgement(len(answer) / 100, f"{len(answer)} characters")


def test_the_scripted_judge_scores_what_the_judge_sent(tmp_path):
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "answer.txt").write_text("x" * 37 + "\n")
    (ws / "src" / "notes.md").write_text("## not a header of the artifact\nline\n\n")
    with ScriptedJudge(_score, api_key="k1") as judge:

        def cfg(rubric="Length.", key="k1"):
            return JudgeConfig(
                base_url=judge.base_url, model="m", rubric=rubric, api_key=key, temperature=0.5
            )

        verdict = asyncio.run(_evaluate(cfg(), ws))
        (sent,) = judge.requests
        with pytest.raises(EvaluatorError, match="not valid JSON"):
            asyncio.run(_evaluate(cfg(rubric="BROKEN"), ws))
        with pytest.raises(EvaluatorError, match="HTTP 401"):
            asyncio.run(_evaluate(cfg(key="wrong"), ws))
        r = httpx.post(
            judge.base_url + "/chat/completions",
            headers={"Authorization": "Bearer k1"},
            json={"messages": [{"role": "user", "content": "hello"}]},
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.post(judge.base_url + "/embeddings", json={}).status_code == 404
    assert verdict.score == pytest.approx(0.38) and verdict.critique == "38 characters"
    assert verdict.details["judge_model"] == "m" and verdict.details["response_id"].startswith("chatcmpl-")
    assert (sent.task, sent.rubric, sent.model, sent.temperature) == ("Write a haiku.", "Length.", "m", 0.5)
    assert "strict evaluator" in sent.system
    assert sent.files() == {
        "answer.txt": "x" * 37 + "\n",
        "src/notes.md": "## not a header of the artifact\nline\n\n",
    }


async def _evaluate(cfg, ws):
    judge = Judge(cfg)
    try:
        return await judge.evaluate(_request(ws))
    finally:
        await judge.aclose()
