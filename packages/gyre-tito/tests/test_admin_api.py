"""The admin API's typed surface: every route needs the admin token, and a body that does not fit its route's model is
a 400 naming the field (before: a hand check per field, and a 500 for whatever one of them missed). What the routes do
with a valid body is tested where it matters (test_server, test_lifecycle, test_hardening)."""

from __future__ import annotations

import httpx
import pytest

from gyre_tito.admin import ROUTES
from gyre_tito.proxy import ProxyConfig
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

ENGINES = ["http://127.0.0.1:9", "http://127.0.0.1:10"]  # never called: a refused body reaches no engine


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tok = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    cfg = ProxyConfig(
        engines=ENGINES,
        tokenizer=str(tok),
        store=str(tmp_path_factory.mktemp("store")),
        admin_token="adm",
        context_from_engines=False,  # nothing listens at ENGINES
    )
    with ProxyServer(cfg) as server:
        server.register("e1")
        yield server


def _path(path: str) -> str:
    return "/admin" + path.replace("{eid}", "e1")


# (method, path, body, the field the answer must name)
MALFORMED = [
    ("POST", "/admin/executions", {"execution_id": 5}, "execution_id"),
    ("POST", "/admin/executions", {"group_id": ""}, "group_id"),
    ("POST", "/admin/executions", {"route": ["ftp://x"]}, "route.0"),
    ("POST", "/admin/executions", {"route": "http://x"}, "route"),
    ("POST", "/admin/executions", {"metadata": [1]}, "metadata"),
    ("PUT", "/admin/executions/e1/route", {"engines": ["ftp://x"]}, "engines.0"),
    ("PUT", "/admin/executions/e1/route", {"engines": [7]}, "engines.0"),
    ("POST", "/admin/executions/e1/export", {"j_max": 1e300}, "j_max"),
    ("POST", "/admin/executions/e1/export", {"j_max": "x"}, "j_max"),
    ("POST", "/admin/executions/e1/export", {"j_max": 0}, "j_max"),
    ("POST", "/admin/executions/e1/export", {"j_max": True}, "j_max"),
    ("POST", "/admin/executions/e1/export", {"seed": 2**70}, "seed"),
    ("POST", "/admin/executions/e1/export", {"include_other": 1}, "include_other"),
    ("POST", "/admin/executions/e1/export", {"path": 5}, "path"),
    ("PUT", "/admin/routes", {}, "engines"),
    ("PUT", "/admin/routes", {"engines": None}, "engines"),
    ("PUT", "/admin/routes", {"engines": ["ftp://x"]}, "engines.0"),
    ("PUT", "/admin/routes", {"engine": [ENGINES[0]]}, "engine"),  # a misspelled key must not empty the pool
    ("PUT", "/admin/routes", {"engines": ENGINES, "extra": 1}, "extra"),
    ("POST", "/admin/engines/drain", {}, "engine"),
    ("POST", "/admin/engines/drain", {"engine": 5}, "engine"),
    ("POST", "/admin/engines/drain", {"engine": ENGINES[0], "timeout_s": "abc"}, "timeout_s"),
    ("POST", "/admin/engines/drain", {"engine": ENGINES[0], "timeout_s": 1e300}, "timeout_s"),
    ("POST", "/admin/engines/drain", {"engine": ENGINES[0], "timeout_s": -1}, "timeout_s"),
    ("POST", "/admin/engines/drain", {"engine": ENGINES[0], "abort_inflight": "no"}, "abort_inflight"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), MALFORMED)
def test_a_malformed_body_is_a_400_naming_the_field(srv, method, path, body, field):
    r = srv.admin(method, path, body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    message = err["error"]["message"]
    assert message.startswith("invalid request body: "), message
    problems = message.removeprefix("invalid request body: ").split("; ")
    assert any(p.startswith(f"{field}: ") for p in problems), message  # the field by name, not just somewhere
    # nothing was applied: the pool, the execution's route and the registry are as they were
    assert [e["url"] for e in srv.proxy.pool.engines()] == ENGINES
    assert srv.proxy.get("e1").route is None and srv.proxy.loaded_executions() == ["e1"]


# the routes with a body
@pytest.mark.parametrize(("method", "path"), sorted({(m, p) for m, p, _, _ in MALFORMED}))
@pytest.mark.parametrize(
    ("raw", "problem"), [(b"{not json", "body: Invalid JSON"), (b"[1]", "body: Input should be")]
)
def test_a_body_that_is_no_json_object_is_a_400(srv, method, path, raw, problem):
    headers = {"Authorization": "Bearer adm", "content-type": "application/json"}
    r = httpx.request(method, srv.url + path, content=raw, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        f"invalid request body: {problem}"
    ), r.text


def test_a_body_is_read_whatever_its_content_type(srv):
    """curl's `-d` sends `application/x-www-form-urlencoded`: the body is still the route's JSON."""
    headers = {"Authorization": "Bearer adm", "content-type": "application/x-www-form-urlencoded"}
    r = httpx.post(srv.url + "/admin/executions", content=b'{"execution_id": 5}', headers=headers, timeout=30)
    assert r.status_code == 400 and "execution_id" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("method", "path"), [(m, p) for m, p, _, _ in ROUTES])
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"x-admin-token": "no"},
        {"Authorization": "Bearer no"},
        {"Authorization": "adm"},
        {"x-api-key": "adm"},
    ],
)
def test_every_admin_route_needs_the_admin_token(srv, method, path, headers):
    # a malformed body too: the token is checked first, so a caller without it learns nothing about the body
    r = httpx.request(method, srv.url + _path(path), content=b"{not json", headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    assert r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "admin token missing or wrong"},
    }
    assert not srv.proxy.get("e1").ended and srv.proxy.loaded_executions() == ["e1"]


def test_the_token_opens_every_get_route(srv):
    """The other side of the check: the same requests with the token (either header) are answered."""
    for method, path, _, _ in ROUTES:
        if method == "GET":
            for headers in ({"x-admin-token": "adm"}, {"Authorization": "Bearer adm"}):
                r = httpx.get(srv.url + _path(path), headers=headers, timeout=30)
                assert r.status_code == 200, (path, r.text)
    assert [e["url"] for e in srv.admin("GET", "/admin/engines").json()["engines"]] == ENGINES
