"""Malformed values against the engine API, gyre-eval's API and the dashboard (issue 37), on loopback.

`test_fuzz.py` draws bodies from each service's schema with finite numbers; here each valid example gets one field
replaced by NaN, an infinity, 2**63, 10**30, `true`, a string, a list, an object or null (NaN and Infinity written
as the JSON extension writes them), or is sent truncated, as non-object JSON, or as text/plain. Every answer is
below 500, and after each one a valid request of the same service still succeeds (nothing held, nothing broken).
The cell worker's `/cell/*` API has its own file (packages/gyre-cell/tests/test_fuzz_cell.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BAD = [float("nan"), float("inf"), float("-inf"), 2**63, 10**30, -(2**63) - 1, True, "1", 1.5, [], {}, None]
RAW = [b"NaN", b"Infinity", b"[]", b'"x"', b"1", b"null", b"", b"\xff\xfe", b"{" * 64]
TESTS = Path(__file__).parent
EVAL_TESTS = TESTS.parent / "packages" / "gyre-eval" / "tests"
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def _nested(example: dict) -> list[tuple[str, ...]]:
    """Paths to every leaf of `example` (one level into lists and objects): the fields a value replaces."""
    paths: list[tuple[str, ...]] = []
    for k, v in example.items():
        paths.append((k,))
        if isinstance(v, dict):
            paths += [(k, k2) for k2 in v]
    return paths


def _replace(example: dict, path: tuple[str, ...], value) -> dict:
    out = json.loads(json.dumps(example))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def fuzz_values(client: httpx.Client, examples: dict[tuple[str, str], dict], still_ok) -> list[str]:
    """Send malformed variants of each example; returns the answers of 500 or more, and any valid request that
    failed after one."""
    bad: list[str] = []
    ops = sorted(examples)

    @SETTINGS
    @given(st.sampled_from(ops), st.data(), st.sampled_from(["application/json", "text/plain"]))
    def one(op, data, content_type):
        method, path = op
        example = examples[op]
        if data.draw(st.booleans(), label="raw"):
            whole = json.dumps(example).encode()
            body = data.draw(st.sampled_from([*RAW, whole[:1], whole[: len(whole) // 2], whole[:-1]]))
        else:
            field = data.draw(st.sampled_from(_nested(example)), label="field")
            body = json.dumps(
                _replace(example, field, data.draw(st.sampled_from(BAD))), allow_nan=True
            ).encode()
        r = client.request(method, path, content=body, headers={"content-type": content_type})
        if r.status_code >= 500:
            bad.append(f"{method} {path} {body[:120]!r} -> {r.status_code} {r.text[:200]}")
        if (problem := still_ok()) is not None:
            bad.append(f"after {method} {path} {body[:120]!r}: {problem}")

    one()
    return bad


def test_engine_api_answers_malformed_values_below_500(tmp_path):
    sys.path.insert(0, str(TESTS))
    from test_fuzz import _engine_server

    from gyre_cell.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    gen = {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 2,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "sampling_seed": 1,
        },
        "return_logprob": True,
    }
    with _engine_server(model, "ek") as (url, engine):
        client = httpx.Client(base_url=url, headers={"authorization": "Bearer ek"}, timeout=60)
        examples = {
            ("POST", "/generate"): gen,
            ("POST", "/update_weights_from_disk"): {"model_path": str(model), "weight_version": "x"},
            ("POST", "/abort_request"): {"rid": "nope"},
        }

        def still_ok() -> str | None:
            r = client.post("/generate", json=gen)
            return None if r.status_code == 200 and len(r.json()["output_ids"]) == 2 else f"{r.status_code}"

        try:
            bad = fuzz_values(client, examples, still_ok)
        finally:
            client.close()
        assert not bad, "\n".join(bad[:10])
        assert not engine.paused and not engine.released


def test_eval_api_answers_malformed_values_below_500(tmp_path):
    sys.path.insert(0, str(EVAL_TESTS))
    from eval_helpers import serve_in_thread, submission
    from eval_plugin_example import RequiredFiles

    from gyre_eval.config import ServiceConfig
    from gyre_eval.server import create_app

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "main.py").write_text("x")
    config = ServiceConfig(retry_wait_min_s=0.01, retry_wait_max_s=0.05, artifact_roots=[str(tmp_path)])
    app = create_app(tmp_path / "run", config, {"task": RequiredFiles(["main.py"])}, token="vt")
    with serve_in_thread(app) as url:
        client = httpx.Client(base_url=url, headers={"authorization": "Bearer vt"}, timeout=60)
        example = json.loads(submission(ws, group_dispatched=2, task={"prompt": "p"}).model_dump_json())

        def still_ok() -> str | None:
            r = client.get("/v1/assessments", params={"limit": 5})
            return (
                None
                if r.status_code == 200 and client.get("/healthz").status_code == 200
                else f"{r.status_code}"
            )

        try:
            bad = fuzz_values(client, {("POST", "/v1/assessments"): example}, still_ok)
            for query in ("limit=NaN", "limit=1e400", "limit=99999999999999999999", "limit=true", "mode=NaN"):
                r = client.get(f"/v1/assessments?{query}")
                if r.status_code >= 500:
                    bad.append(f"GET /v1/assessments?{query} -> {r.status_code}")
                r = client.get(f"/v1/groups?{query}")
                if r.status_code >= 500:
                    bad.append(f"GET /v1/groups?{query} -> {r.status_code}")
            # lax mode took `true` for a count of 1: a count is a JSON integer
            r = client.post("/v1/assessments", json={**example, "execution_id": "strict", "group_size": True})
            assert r.status_code == 422, r.text
        finally:
            client.close()
        assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize("token", [None, "dt"])
def test_dashboard_answers_malformed_requests_below_500(tmp_path, token):
    sys.path[:0] = [str(TESTS), str(EVAL_TESTS)]
    from eval_helpers import serve_in_thread
    from test_dashboard import make_run

    from gyre.observe.dashboard.server import make_app
    from gyre.observe.rundata import RunView

    make_run(tmp_path / "run")
    with serve_in_thread(make_app(RunView(tmp_path / "run"), token=token)) as url:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        client = httpx.Client(base_url=url, headers=headers, timeout=60)
        ids = [
            "NaN",
            "Infinity",
            str(2**63),
            str(10**30),
            "true",
            "%00",
            "..%2F..%2Fetc%2Fpasswd",
            "x" * 5000,
            "%F0%9F%99%82",
            "%ff%fe",
            "g0.e0%00",
        ]
        bad = []
        try:
            for eid in ids:
                for method in ("GET", "POST", "PUT"):
                    r = client.request(method, f"/api/execution/{eid}", content=b'{"x": NaN}')
                    if r.status_code >= 500:
                        bad.append(f"{method} /api/execution/{eid[:40]} -> {r.status_code}")
                for path in (f"/static/{eid}", f"/api/summary?token={eid}", f"/?refresh={eid}"):
                    if (r := client.get(path)).status_code >= 500:
                        bad.append(f"GET {path[:60]} -> {r.status_code}")
                if client.get("/api/summary").status_code != 200:
                    bad.append(f"/api/summary failed after {eid[:40]}")
            assert client.get("/api/execution/g0.e0").status_code == 200
        finally:
            client.close()
        assert not bad, "\n".join(bad[:10])
