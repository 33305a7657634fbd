"""Judge-rubric tasks in `gyre run`: scored by gyre-eval's judge through the run's own TITO proxy.

The judge is registered at the proxy as its own execution (`judge`), its credential in a private 0600 file that the
service config (written out with secrets masked, as `gyre run` hands it to the gyre-eval process) points to. The
proxy runs on the scripted engine, which scores a workspace 1.0 when its answer holds the marker and 0.25 otherwise.
We assert the scores, that every judge call is recorded under the judge's own execution with the rubric, task and
artifact in its prompt, and that the credential is nowhere in the written config."""

import asyncio
import json
import stat
import time

from gyre.config import JudgeSection
from gyre.datasets import task_queries
from gyre.run.judging import JUDGE_EXECUTION, judge_endpoint
from gyre.run.pipeline import _assessment_config
from gyre_eval.config import load_config
from gyre_eval.service import AssessmentService
from gyre_eval.store import AssessmentStore
from gyre_eval.types import Submission
from gyre_sched.runner import ExecutionRunner
from gyre_tito.proxy import ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer, load_tiny_tokenizer

RUBRIC = "Full marks when answer.txt names the colour of the sky; none otherwise."
TASK = {
    "workspace": {"empty": True},
    "scoring": {"kind": "judge", "rubric": RUBRIC},
    "harness_timeout_s": 60,
    "overall_budget_s": 120,
}
TASKS = [
    TASK | {"query_id": "sky", "prompt": "Write the colour of the sky into answer.txt."},
    TASK | {"query_id": "sky2", "prompt": "Write the colour of the sky into answer.txt again."},
]


def test_judge_tasks_are_scored_through_the_runs_proxy(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    rules = [
        ScriptRule(contains=["# Rubric", "MARKER-BLUE"], reply='{"score": 1.0, "critique": "blue"}'),
        ScriptRule(contains=["# Rubric"], reply='{"score": 0.25, "critique": "no colour"}'),
    ]
    engine = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), rules=rules))
    url = engine.start()
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    queries = task_queries(task_file)
    run_dir = tmp_path / "run"
    cfg = ProxyConfig(engines=[url], tokenizer=str(tok), store=str(tmp_path / "store"), admin_token="adm")
    try:
        with ProxyServer(cfg) as srv:
            scores, config_text, key_file = asyncio.run(_assess(srv.url, run_dir, queries))
            judge_calls = list(srv.proxy.executions[JUDGE_EXECUTION].records.tree.records())
            credential = key_file.read_text()
    finally:
        engine.stop()

    assert scores == {"ws-blue": ("valid", 1.0), "ws-none": ("valid", 0.25)}
    assert len(judge_calls) == 2  # one per assessment, recorded under the judge's own execution
    text = load_tiny_tokenizer(tok)
    prompts = [text.decode(list(r.input_ids), skip_special_tokens=False) for r in judge_calls]
    assert all(RUBRIC in p and TASKS[0]["prompt"] in p for p in prompts)
    assert sum("MARKER-BLUE" in p for p in prompts) == 1  # the artifact: each workspace's own answer
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and credential
    assert credential not in config_text and str(key_file) in config_text


async def _assess(proxy_url, run_dir, queries):
    runner = ExecutionRunner(run_dir, proxy_url, "adm", {"kind": "builtin"}, 60.0)
    try:
        endpoint = await judge_endpoint(JudgeSection(), proxy_url, runner.admin_call, run_dir / "private")
    finally:
        await runner.aclose()
    config_file = run_dir / "private" / "gyre-eval.json"  # as gyre run writes it for the gyre-eval process
    config_file.write_text(_assessment_config(run_dir, queries, endpoint).model_dump_json())
    service = AssessmentService(AssessmentStore(run_dir), load_config(config_file))
    scores = {}
    try:
        for i, (name, answer) in enumerate([("ws-blue", "MARKER-BLUE\n"), ("ws-none", "\n")]):
            ws = run_dir / "workspaces" / name
            ws.mkdir(parents=True)
            (ws / "answer.txt").write_text(answer)
            sub = Submission(
                execution_id=name,
                group_id="g",
                group_size=2,
                dispatch_index=i,
                artifact_ref=str(ws),
                evaluator="task-sky",
                launched_at=time.time(),
                budget_s=60.0,
                task={"prompt": TASKS[0]["prompt"]},
            )
            assessment, _ = service.submit(sub)
            done = await service.wait(assessment.id)
            scores[name] = (done.status, done.score)
    finally:
        await service.close()
    return scores, config_file.read_text(), run_dir / "private" / "judge.key"
