"""The proxy's operator endpoints on its public port (which agents reach too, through the sandbox's relay).

`/metrics` needs the admin token: its counters describe every execution (calls, tokens, engines in flight, error
statuses), not the caller's own. `/health` answers anyone with a bare liveness `{"status": "ok"}`, which says no
more than the open port does (launchers and probes hold no token); its details (engines, execution counts,
quarantine) need the admin token.
"""

from __future__ import annotations

import httpx
import pytest

from gyre_tito.proxy import ProxyConfig
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

ENGINE = "http://127.0.0.1:9"  # never called: these endpoints only list it


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tok = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    cfg = ProxyConfig(
        engines=[ENGINE],
        tokenizer=str(tok),
        store=str(tmp_path_factory.mktemp("store")),
        admin_token="adm-secret",
    )
    with ProxyServer(cfg) as server:
        yield server


def test_metrics_need_the_admin_token(srv):
    _, credential = srv.register("e-metrics")  # an agent's own credential is not the operator's
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"x-admin-token": "adm-secre"},
        {"authorization": f"Bearer {credential}"},
        {"x-api-key": credential},
    ):
        r = httpx.get(srv.url + "/metrics", headers=headers)
        assert r.status_code == 401, headers
        assert "gyre_tito" not in r.text
    r = srv.admin("GET", "/metrics")
    assert r.status_code == 200 and "gyre_tito_calls_total" in r.text
    assert httpx.get(srv.url + "/metrics", headers={"x-admin-token": "adm-secret"}).status_code == 200


def test_health_tells_anyone_only_that_it_is_up(srv):
    _, credential = srv.register("e-health")
    for headers in ({}, {"authorization": f"Bearer {credential}"}):
        r = httpx.get(srv.url + "/health", headers=headers)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert ENGINE not in r.text
    details = srv.admin("GET", "/health").json()
    assert details["status"] == "ok" and [e["url"] for e in details["engines"]] == [ENGINE]
    assert details["executions"] >= 1 and details["quarantined"] == 0


def test_without_an_admin_token_metrics_are_closed(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    cfg = ProxyConfig(engines=[ENGINE], tokenizer=str(tok), store=str(tmp_path / "store"))
    with ProxyServer(cfg) as server:
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/metrics", headers={"x-admin-token": "None"}).status_code == 401
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
