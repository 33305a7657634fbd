"""Issue 15 regressions for gyre-eval: a service token, artifact roots, and bad numbers or nesting are 4xx."""

from __future__ import annotations

import json

import httpx
from eval_helpers import run, serve_in_thread, submission
from eval_plugin_example import RequiredFiles

from gyre_eval.client import EvalClient
from gyre_eval.config import ServiceConfig
from gyre_eval.errors import EvalServiceError
from gyre_eval.server import create_app

CONFIG = ServiceConfig(retry_wait_min_s=0.05, retry_wait_max_s=0.2)


def _app(tmp_path, config=CONFIG, **kw):
    return create_app(tmp_path / "run", config, {"task": RequiredFiles(["main.py", "tests.py"])}, **kw)


def test_the_service_token_keeps_other_processes_from_submitting_rewards(tmp_path, workspace):
    """Before: any local process could submit another execution's reward first (the real one then got 409)."""
    sub = submission(workspace)
    body = json.loads(sub.model_dump_json())

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url) as anon:
            assert (await anon.get("/healthz")).status_code == 200
            for method, path in [
                ("POST", "/v1/assessments"),
                ("GET", "/v1/groups"),
                ("GET", "/v1/assessments"),
            ]:
                r = await anon.request(method, path, json=body)
                assert r.status_code == 401 and r.json()["error"] == "unauthorized", (path, r.text)
            r = await anon.post("/v1/assessments", json=body, headers={"authorization": "Bearer nope"})
            assert r.status_code == 401
        async with EvalClient(url, token="tok") as client:
            a = await client.submit(sub)
            return await client.wait_final(a.id, timeout=10)

    with serve_in_thread(_app(tmp_path, token="tok")) as url:
        final = run(scenario(url))
    assert final.status == "valid" and final.execution_id == sub.execution_id


def test_artifact_ref_must_resolve_under_the_artifact_roots(tmp_path, workspace):
    """Before: a caller could have any folder the service can read (a root-only one) copied in and assessed."""
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "main.py").write_text("x")
    link = workspace.parent / "link"
    link.symlink_to(outside)
    config = ServiceConfig(retry_wait_min_s=0.05, artifact_roots=[str(workspace)])

    async def scenario(url):
        async with EvalClient(url) as client:
            for i, ref in enumerate([str(outside), str(link), str(workspace) + "/../../secret"]):
                try:
                    await client.submit(
                        submission(workspace, f"bad{i}").model_copy(update={"artifact_ref": ref})
                    )
                    raise AssertionError(f"{ref} accepted")
                except EvalServiceError as e:
                    assert e.status == 422 and e.error == "artifact_outside_roots", e
            return await client.submit(submission(workspace, "ok"))

    with serve_in_thread(_app(tmp_path, config)) as url:
        ok = run(scenario(url))
    assert ok.execution_id == "ok"


def _nested_list(n):
    v: list = [1]
    for _ in range(n):
        v = [v]
    return v


def test_infinite_deadlines_and_deep_tasks_are_422(tmp_path, workspace):
    base = json.loads(submission(workspace).model_dump_json())
    deep: dict = {}
    node = deep
    for _ in range(900):
        node["x"] = {}
        node = node["x"]
    bad = [
        {**base, "launched_at": 1e308, "budget_s": 1e308},
        {**base, "budget_s": 1e300},
        {**base, "task": deep},
        {**base, "task": {"a": _nested_list(40)}},
    ]

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url) as http:
            return [await http.post("/v1/assessments", json=b) for b in bad]

    with serve_in_thread(_app(tmp_path)) as url:
        answers = run(scenario(url))
    for r in answers:
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "invalid_request"
