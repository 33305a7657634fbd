"""Fuzz suite (issue 15): hypothesis over each service's own OpenAPI schema, against the real HTTP servers on loopback.

For the proxy (`gyre-tito`), the torch engine (`gyre-cell`) and the reward service (`gyre-eval`): every path and
method listed in `/openapi.json` gets bodies drawn from its request schema where it has one (a small JSON-schema
strategy resolving `$ref`s), from mutations of a valid example of that endpoint, and from arbitrary JSON; path
parameters are drawn too. A bounded number of examples per service (`FUZZ_EXAMPLES`, default 40). Checked:
- no answer is a 5xx (a crash shows up as 500; 529/503 would mean the fuzz took the service down);
- `/health` answers while a body of the largest size the service accepts (and one past it) is half-way uploaded (the
  upload waits for it), and none of a polling thread's probes fails through the parse and the reply;
- record logs written before the fuzz are byte-identical after it (proxy).
Authenticated endpoints are fuzzed with their tokens: a 401 would test only the guard.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=30) | st.sampled_from(
    ["\ue000R", "\ue000R0\ue001", "../../etc/passwd", "x" * 300, "", "%00", "\x00", "-1", "1e400", "NaN"]
)


def _from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values for a (subset of) JSON schema; anything it does not understand becomes arbitrary JSON."""
    if depth > 6:
        return JSON
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return _from_schema(components.get(name, {}), components, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return st.one_of([_from_schema(s, components, depth + 1) for s in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"]) | JSON
    t = schema.get("type")
    if t == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {k: _from_schema(v, components, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required} | {"zz_unknown": JSON},
        )
    if t == "array":
        return st.lists(_from_schema(schema.get("items", {}), components, depth + 1), max_size=4)
    if t == "string":
        return TEXT
    if t == "integer":
        return st.integers(-(2**64), 2**64) | st.sampled_from([0, -1, 1, 65535, 70000])
    if t == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e-40, 1e308, -0.0])
    if t == "boolean":
        return st.booleans()
    return JSON


def _mutations(example: dict) -> st.SearchStrategy:
    """A valid example with one field replaced, removed, or a field added."""
    keys = sorted(example)
    replace = st.tuples(st.sampled_from(keys), JSON | TEXT).map(lambda kv: {**example, kv[0]: kv[1]})
    drop = st.sampled_from(keys).map(lambda k: {x: v for x, v in example.items() if x != k})
    return replace | drop | st.just(example)


def _operations(spec: dict) -> list[tuple[str, str, dict]]:
    ops = []
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            if method in ("get", "post", "put", "delete", "patch"):
                ops.append((method.upper(), path, op))
    return ops


def _fill_path(path: str, value: str) -> str:
    out = path
    while "{" in out:
        a, b = out.index("{"), out.index("}")
        out = out[:a] + quote(value or "x", safe="") + out[b + 1 :]
    return out


class Watch:
    """Polls a health URL from a thread and keeps its failures."""

    def __init__(self, url: str) -> None:
        self.url, self.errors = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                try:
                    if (status := c.get(self.url).status_code) != 200:
                        self.errors.append(f"status {status}")
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))
                self._stop.wait(0.02)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def fuzz_service(base: str, headers: dict, examples: dict[tuple[str, str], dict], skip=()) -> list[str]:
    """Run the bounded fuzz over every operation of `base`/openapi.json; returns the 5xx answers seen."""
    spec = httpx.get(base + "/openapi.json", headers=headers, timeout=30).json()
    components = spec.get("components", {}).get("schemas", {})
    ops = [(m, p, op) for m, p, op in _operations(spec) if (m, p) not in skip]
    assert ops, "no operations in the schema"
    bad: list[str] = []
    client = httpx.Client(base_url=base, headers=headers, timeout=60)

    bodies = []
    for m, p, op in ops:
        schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        strat = JSON
        if schema is not None:
            strat = _from_schema(schema, components) | strat
        if (m, p) in examples:
            strat = _mutations(examples[(m, p)]) | strat
        bodies.append(st.tuples(st.just((m, p)), strat, TEXT))

    @SETTINGS
    @given(st.one_of(bodies))
    def one(case):
        (method, path), body, param = case
        url = _fill_path(path, param)
        if method == "GET":
            r = client.request(method, url, params={"after": param, "limit": param, "mode": param})
        else:
            r = client.request(method, url, content=json.dumps(body).encode())
        if r.status_code >= 500:
            bad.append(f"{method} {url} {json.dumps(body)[:200]} -> {r.status_code} {r.text[:200]}")

    try:
        one()
        # raw bytes that are not JSON at all, and an empty body
        for m, p, _ in ops:
            if m != "GET":
                for raw in (b"", b"{", b"\xff\xfe", b"[]" * 1000, b'{"a":' * 200):
                    r = client.request(m, _fill_path(p, "x"), content=raw)
                    if r.status_code >= 500:
                        bad.append(f"{m} {p} raw {raw[:20]!r} -> {r.status_code}")
    finally:
        client.close()
    return bad


def large_body_statuses(base: str, health: str, headers: dict, path: str, size: int) -> list[int]:
    """Send bodies of `size` bytes (a JSON string) and 2x past it to `path`; half-way through each upload, with the
    service holding a partial body, `health` must answer 200 (a gate, not a timer: the upload waits for it). A thread
    keeps probing `health` meanwhile, through the parse and the reply too; none of its probes may fail."""
    statuses = []
    with (
        Watch(base + health) as w,
        httpx.Client(base_url=base, headers=headers, timeout=120) as c,
        httpx.Client(timeout=120) as probe,
    ):
        for n in (size, 2 * size):
            body = (
                b'{"pad": "'
                + b"a" * n
                + b'", "messages": [{"role": "user", "content": "'
                + b"b" * n
                + b'"}]}'
            )
            mid: list[int] = []

            def upload(body: bytes = body, mid: list[int] = mid):
                yield body[: len(body) // 2]
                mid.append(probe.get(base + health).status_code)  # the first half is on the wire
                yield body[len(body) // 2 :]

            sent = c.post(path, content=upload(), headers={"content-length": str(len(body))})
            assert mid == [200], f"{health} did not answer while {path} held a partial body: {mid}"
            statuses.append(sent.status_code)
    assert w.errors == [], w.errors[:3]
    assert httpx.get(base + health, timeout=120).status_code == 200
    return statuses


# ---- the proxy -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fuzz_proxy(tmp_path):
    from gyre_tito.proxy import ProxyConfig
    from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig
    from gyre_tito.testing import ProxyServer
    from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tok")
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), default_reply="ok " * 5))
    url = eng.start()
    cfg = ProxyConfig(
        engines=[url],
        tokenizer=str(tok),
        store=str(tmp_path / "store"),
        admin_token="adm",
        max_request_bytes=2 << 20,
        export_dirs=[str(tmp_path / "out")],
    )
    try:
        with ProxyServer(cfg) as srv:
            # records made before the fuzz
            _, cred = srv.register("before")
            for text in ("one", "two"):
                body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": text}]}
                assert (
                    httpx.post(srv.url + "/v1/messages", headers={"x-api-key": cred}, json=body).status_code
                    == 200
                )
            srv.admin("POST", "/admin/executions/before/end")
            records = tmp_path / "store" / "records"
            before = {
                p.name: p.read_bytes() for p in records.iterdir() if p.name.endswith(".tito.jsonl")
            }  # not the journal
            _, live = srv.register("fuzz")
            msg = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            examples = {
                ("POST", "/v1/messages"): msg,
                ("POST", "/v1/messages/count_tokens"): msg,
                ("POST", "/v1/chat/completions"): {
                    "model": "m",
                    "messages": [{"role": "user", "content": "hi"}],
                },
                ("POST", "/admin/executions"): {"execution_id": "x", "group_id": "g"},
                ("POST", "/admin/executions/{eid}/export"): {
                    "j_max": 2,
                    "path": str(tmp_path / "out" / "t.jsonl"),
                },
                ("PUT", "/admin/routes"): {"engines": [url]},
                ("POST", "/admin/engines/drain"): {"engine": "http://127.0.0.1:9", "timeout_s": 0},
            }
            headers = {"authorization": "Bearer adm", "x-api-key": live}
            # never end or drain the live engine during the fuzz (that would only test a proxy without engines)
            skip = {("POST", "/admin/executions/{eid}/end")}
            bad = fuzz_service(srv.url, headers, examples, skip)
            assert not bad, "\n".join(bad[:10])
            assert srv.admin("PUT", "/admin/routes", {"engines": [url]}).status_code == 200
            statuses = large_body_statuses(srv.url, "/health", {"x-api-key": live}, "/v1/messages", 1 << 20)
            assert all(s < 500 for s in statuses) and statuses[-1] == 413, statuses
            after = {p.name: p.read_bytes() for p in records.iterdir() if p.name in before}
            assert after == before  # records made before the fuzz are byte-identical
    finally:
        eng.stop()


# ---- the torch engine ----------------------------------------------------------------------------------------------


@contextmanager
def _engine_server(model, api_key):
    import uvicorn

    from gyre_cell.engine import EngineConfig, TorchEngine
    from gyre_cell.engine.server import create_app

    engine = TorchEngine(
        EngineConfig(model_path=str(model), device="cpu", max_total_tokens=4096, weight_dirs=[])
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, api_key=api_key), host="127.0.0.1", port=0, log_level="warning")
    )
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)  # start-up poll, not an ordering assumption
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", engine
    finally:
        server.should_exit = True
        th.join(10)
        engine.close()


@pytest.mark.slow
def test_fuzz_engine(tmp_path):
    from gyre_cell.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    with _engine_server(model, "ek") as (url, engine):
        gen = {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4, "temperature": 1e-40},
            "return_logprob": True,
        }
        examples = {
            ("POST", "/generate"): gen,
            ("PUT", "/generate"): gen,
            ("POST", "/update_weights_from_disk"): {"model_path": str(model), "weight_version": "x"},
            ("POST", "/init_weights_update_group"): {
                "master_address": "127.0.0.1",
                "master_port": 70000,
                "rank_offset": 1,
                "world_size": 2,
            },
            ("POST", "/abort_request"): {"rid": "nope"},
            ("POST", "/update_weights_from_tensor"): {"serialized_named_tensors": ["AAAA"]},
        }
        # pausing or releasing memory is legitimate for the token holder; the fuzz leaves the engine serving
        skip = {
            ("POST", "/pause_generation"),
            ("GET", "/release_memory_occupation"),
            ("POST", "/release_memory_occupation"),
            ("POST", "/init_weights_update_group"),
        }
        bad = fuzz_service(url, {"authorization": "Bearer ek"}, examples, skip)
        assert not bad, "\n".join(bad[:10])
        assert not engine.paused and not engine.released
        r = httpx.post(url + "/generate", json=gen, headers={"authorization": "Bearer ek"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4  # still serving after the fuzz
        statuses = large_body_statuses(url, "/health", {"authorization": "Bearer ek"}, "/generate", 1 << 20)
        assert all(s < 500 for s in statuses), statuses


# ---- gyre-eval -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fuzz_eval(tmp_path):
    import sys

    sys.path.insert(
        0, str(__import__("pathlib").Path(__file__).parents[1] / "packages" / "gyre-eval" / "tests")
    )
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
        example = json.loads(submission(ws).model_dump_json())
        bad = fuzz_service(url, {"authorization": "Bearer vt"}, {("POST", "/v1/assessments"): example})
        assert not bad, "\n".join(bad[:10])
        statuses = large_body_statuses(
            url, "/healthz", {"authorization": "Bearer vt"}, "/v1/assessments", 1 << 20
        )
        assert all(s < 500 for s in statuses), statuses


def test_the_json_schema_strategy_covers_refs_and_unknown_fields():
    schema = {"$ref": "#/components/schemas/S"}
    components = {"S": {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}}
    seen = []

    @settings(max_examples=20, derandomize=True, deadline=None)
    @given(_from_schema(schema, components))
    def probe(v):
        seen.append(v)

    probe()
    assert all("a" in v for v in seen) and all(set(v) <= {"a", "zz_unknown"} for v in seen)
