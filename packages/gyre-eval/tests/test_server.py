"""The HTTP service on loopback: idempotent submission, 100 concurrent submissions, 4xx errors, groups, restart."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from eval_helpers import free_port, run, serve_in_thread, submission
from eval_plugin_example import RequiredFiles

from gyre_eval.client import EvalClient
from gyre_eval.config import ServiceConfig
from gyre_eval.errors import EvalServiceError
from gyre_eval.server import create_app
from gyre_eval.types import ErrorBody, Submission

JSON_HEADERS = {"content-type": "application/json"}
CONFIG = ServiceConfig(retry_wait_min_s=0.05, retry_wait_max_s=0.2)


def _app(tmp_path):
    return create_app(tmp_path / "run", CONFIG, {"task": RequiredFiles(["main.py", "tests.py"])})


def test_submit_is_idempotent_and_status_is_queryable(tmp_path, workspace):
    sub = submission(workspace, outcome="harness_timeout")

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url) as http, EvalClient(url) as client:
            first = await http.post("/v1/assessments", json=json.loads(sub.model_dump_json()))
            second = await http.post("/v1/assessments", json=json.loads(sub.model_dump_json()))
            assert (first.status_code, second.status_code) == (201, 200)
            assert first.json()["id"] == second.json()["id"]
            final = await client.wait_final(first.json()["id"], timeout=10)
            again = await client.submit(sub)  # after completion: still the same assessment
            report = await client.execution("e0")
            attempts = await client.attempts(final.id)
            listed = await client.list(group_id="g0", status="valid", designated=True)
            return final, again, report, attempts, listed

    with serve_in_thread(_app(tmp_path)) as url:
        final, again, report, attempts, listed = run(scenario(url))
    assert (final.status, final.score, final.attempts) == ("valid", 0.5, 1)
    assert final.provenance.critique == "missing: tests.py" and final.provenance.outcome == "harness_timeout"
    assert again == final
    assert (report.reward, report.status, report.excluded, report.history) == (0.5, "valid", False, [final])
    assert [t.ok for t in attempts] == [True]
    assert listed == [final]


def test_one_hundred_concurrent_submissions(tmp_path, workspace):
    t0 = time.time()
    subs = [
        submission(workspace, f"e{g}-{i}", group_id=f"g{g}", group_size=4, dispatch_index=i, launched_at=t0)
        for g in range(25)
        for i in range(4)
    ]

    async def scenario(url):
        async with EvalClient(url) as client:
            created = await asyncio.gather(*(client.submit(s) for s in subs))
            duplicates = await asyncio.gather(*(client.submit(s) for s in reversed(subs)))
            finals = await asyncio.gather(*(client.wait_final(a.id, timeout=60) for a in created))
            groups = await client.groups(state="ready")
            everything = await client.list(limit=1000)
            return created, duplicates, finals, groups, everything

    with serve_in_thread(_app(tmp_path)) as url:
        created, duplicates, finals, groups, everything = run(scenario(url))
    assert len({a.id for a in created}) == 100
    assert {a.id for a in duplicates} == {a.id for a in created}
    assert all(a.status == "valid" and a.score == 0.5 for a in finals)
    assert len(everything) == 100 and len(groups) == 25
    assert all([m.advantage for m in g.members] == [0.0] * 4 for g in groups)


def _error(response: httpx.Response) -> ErrorBody:
    return ErrorBody.model_validate(response.json())


def test_malformed_and_conflicting_requests_get_4xx_with_a_message(tmp_path, workspace):
    good = json.loads(submission(workspace).model_dump_json())

    with serve_in_thread(_app(tmp_path)) as url, httpx.Client(base_url=url) as http:
        cases = [
            (http.post("/v1/assessments", content=b"{not json", headers=JSON_HEADERS), 422, "JSON"),
            (http.post("/v1/assessments", content=b"{}"), 422, "dictionary"),  # no JSON content type
            (
                http.post("/v1/assessments", json={k: v for k, v in good.items() if k != "group_id"}),
                422,
                "group_id",
            ),
            (http.post("/v1/assessments", json={**good, "budget_s": "soon"}), 422, "budget_s"),
            (http.post("/v1/assessments", json={**good, "api_key": "sk-exec"}), 422, "api_key"),
            (http.post("/v1/assessments", json={**good, "dispatch_index": 5}), 422, "out of range"),
            (http.post("/v1/assessments", json=[1, 2]), 422, "body"),
            (http.post("/v1/assessments", json={**good, "evaluator": "nope"}), 422, "unknown evaluator"),
            (http.get("/v1/assessments/a-missing"), 404, "no assessment a-missing"),
            (http.get("/v1/assessments", params={"status": "maybe"}), 422, "status"),
            (http.get("/v1/groups/nope"), 404, "no group nope"),
            (http.get("/v1/groups", params={"mode": "ppo"}), 422, "mode"),
            (http.get("/v1/executions/nobody"), 404, "no assessment of execution"),
            (http.get("/v1/nowhere"), 404, "Not Found"),
        ]
        assert http.post("/v1/assessments", json=good).status_code == 201
        conflict = http.post("/v1/assessments", json={**good, "launched_at": good["launched_at"] + 5})
        cases.append((conflict, 409, "different launched_at"))
        second = {**good, "artifact_version": "v2"}
        cases.append((http.post("/v1/assessments", json=second), 409, "already has its designated"))
        for response, status, needle in cases:
            assert response.status_code == status, (needle, response.text)
            body = _error(response)
            assert needle in body.message, (needle, body)


def test_client_raises_service_errors_with_the_message(tmp_path, workspace):
    async def scenario(url):
        async with EvalClient(url) as client:
            with pytest.raises(EvalServiceError) as info:
                await client.get("a-unknown")
            return info.value

    with serve_in_thread(_app(tmp_path)) as url:
        error = run(scenario(url))
    assert (error.status, error.error) == (404, "not_found") and "a-unknown" in error.message


def test_group_endpoints_report_ready_advantages_and_drops(tmp_path, tmp_path_factory):
    full = tmp_path / "full"
    (full / "x").mkdir(parents=True)
    (full / "main.py").write_text("")
    (full / "tests.py").write_text("")
    half = tmp_path / "half"
    half.mkdir()
    (half / "main.py").write_text("")
    t0 = time.time()
    subs = [
        submission(full, "a0", group_id="ga", group_size=2, dispatch_index=0, launched_at=t0),
        submission(half, "a1", group_id="ga", group_size=2, dispatch_index=1, launched_at=t0),
        submission(full, "b0", group_id="gb", group_size=2, dispatch_index=0, launched_at=t0),
        # Budget spent before assessment: excluded, and with no spare the group can never be completed.
        submission(
            half, "b1", group_id="gb", group_size=2, dispatch_index=1, launched_at=t0 - 100, budget_s=10
        ),
    ]

    async def scenario(url):
        async with EvalClient(url) as client:
            for s in subs:
                await client.wait_final((await client.submit(s)).id, timeout=10)
            return await client.group("ga"), await client.group("ga", mode="mean"), await client.group("gb")

    with serve_in_thread(_app(tmp_path)) as url:
        grpo, mean, dropped = run(scenario(url))
    assert grpo.state == "ready" and [m.reward for m in grpo.members] == [1.0, 0.5]
    assert [m.advantage for m in grpo.members] == pytest.approx([1.0, -1.0], abs=1e-4)
    assert [m.advantage for m in mean.members] == [0.25, -0.25] and mean.advantage_mode == "mean"
    assert (dropped.state, dropped.excluded) == ("dropped", 1) and "excluded" in dropped.reason


def _start_server(store, port, config_path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gyre_eval.cli",
            "serve",
            "--store",
            str(store),
            "--port",
            str(port),
            "--config",
            str(config_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server did not become healthy")


@pytest.mark.slow  # two real server start-ups (~4 s each on a loaded 2-core box)
def test_service_restart_in_the_middle_of_an_evaluation_loses_no_assessment(tmp_path, workspace):
    store = tmp_path / "run"
    marker = tmp_path / "slow-started"
    release = tmp_path / "release"  # gate: the attempt holds until the server is killed (no sleep races)
    config = {
        "retry_wait_min_s": 0.05,
        "retry_wait_max_s": 0.2,
        "evaluators": {
            "quick": {"kind": "exec", "command": ["true"], "sandbox": {"isolation": "off", "timeout_s": 10}},
            # Unsandboxed so it can drop a marker that shows the attempt is running when the server dies.
            "task": {
                "kind": "exec",
                "command": [
                    "bash",
                    "-c",
                    f"touch {marker}; while [ ! -e {release} ]; do sleep 0.05; done; grep -q hello main.py",
                ],
                "sandbox": {"isolation": "off", "timeout_s": 120, "scratch_dir": str(tmp_path)},
            },
        },
    }
    config_path = tmp_path / "eval.json"
    config_path.write_text(json.dumps(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    subs = [
        submission(workspace, "q0", group_size=3, dispatch_index=0, evaluator="quick", launched_at=t0),
        submission(workspace, "q1", group_size=3, dispatch_index=1, evaluator="quick", launched_at=t0),
        submission(workspace, "slow", group_size=3, dispatch_index=2, launched_at=t0),
    ]
    proc = _start_server(store, port, config_path)
    try:
        _wait_healthy(url, proc)
        assert json.loads((store / "gyre-eval.config.json").read_text())["evaluators"]["quick"][
            "command"
        ] == ["true"]
        with httpx.Client(base_url=url) as http:
            ids = [
                http.post("/v1/assessments", json=json.loads(s.model_dump_json())).json()["id"] for s in subs
            ]
            end = time.monotonic() + 20
            while not marker.exists() and time.monotonic() < end:
                time.sleep(0.05)
            assert marker.exists()
            before = {i: http.get(f"/v1/assessments/{i}").json() for i in ids}
        os.kill(proc.pid, signal.SIGKILL)  # no graceful shutdown
        proc.wait(10)
        assert before[ids[2]]["final"] is False
        release.touch()  # the restarted service's attempt runs through
        proc = _start_server(store, port, config_path)
        _wait_healthy(url, proc)
        client_result = run(_after_restart(url, ids))
    finally:
        proc.kill()
        proc.wait(10)
    finals, group = client_result
    assert [a.id for a in finals] == ids
    assert all(a.status == "valid" and a.score == 1.0 and a.final for a in finals)
    assert group.state == "ready" and len(group.members) == 3


async def _after_restart(url, ids):
    async with EvalClient(url) as client:
        finals = [await client.wait_final(i, timeout=30) for i in ids]
        return finals, await client.group("g0")


def test_submission_schema_round_trips_through_the_client_shape(workspace):
    sub = submission(workspace)
    assert Submission.model_validate_json(sub.model_dump_json()) == sub


def test_every_outcome_the_runner_produces_is_accepted_and_kept(tmp_path, workspace):
    """One vocabulary: the execution outcome is the runner's (gyre_sched.types.Outcome). gyre-eval once had its own
    list ("timed_out" where the runner says "harness_timeout"), so the first harness timeout of a run was refused
    with a 422 and ended the run. Every outcome the producer defines goes through the HTTP API and is recorded as
    sent; a word outside the producer's vocabulary is a 422 that names the field."""
    from typing import get_args

    from gyre_sched.types import Outcome

    outcomes = get_args(Outcome)
    assert "harness_timeout" in outcomes

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url) as http, EvalClient(url) as client:
            finals = {}
            for i, outcome in enumerate(outcomes):
                sub = submission(workspace, f"e-{outcome}", group_id=f"g{i}", outcome=outcome)
                created = await client.submit(sub)
                finals[outcome] = await client.wait_final(created.id, timeout=30)
            bad = json.loads(submission(workspace, "e-bad", group_id="gb").model_dump_json())
            refused = await http.post("/v1/assessments", json={**bad, "outcome": "timed_out"})
            return finals, refused

    with serve_in_thread(_app(tmp_path)) as url:
        finals, refused = run(scenario(url))
    assert {o: (a.status, a.provenance.outcome) for o, a in finals.items()} == {
        o: ("valid", o) for o in outcomes
    }
    assert refused.status_code == 422 and "outcome" in refused.text
