"""Per-call sampling parameters (pin / refuse / pass, recorded asked + used) and max_tokens against the context."""

import httpx
import pytest

from gyre_tito.proxy import ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def engine(tok_dir):
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=[ScriptRule(reply="ok " * 20)]))
    eng.start()
    yield eng
    eng.stop()


def _server(tok_dir, tmp_path, eng, **kw) -> ProxyServer:
    cfg = ProxyConfig(
        engines=[eng.url], tokenizer=str(tok_dir), store=str(tmp_path / "store"), admin_token="adm", **kw
    )
    return ProxyServer(cfg)


def _anthropic(url, cred, max_tokens=300, content="hi", **kw):
    body = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}], **kw}
    return httpx.post(url + "/v1/messages?beta=true", headers={"x-api-key": cred}, json=body, timeout=30)


def test_pin_sends_the_runs_values_and_records_asked_and_used(tok_dir, tmp_path, engine):
    with _server(tok_dir, tmp_path, engine, sampling_policy="pin", temperature=0.7) as srv:
        eid, cred = srv.register("pin")
        r = _anthropic(srv.url, cred, temperature=0.3, top_p=0.9)
        assert r.status_code == 200, r.text
        sp = engine.requests[-1]["sampling_params"]
        assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (0.7, 1.0, -1)
        (rec,) = srv.proxy.executions[eid].records.tree.records()
        assert rec.metadata["sampling"] == {
            "policy": "pin",
            "asked": {"temperature": 0.3, "top_p": 0.9, "max_tokens": 300},
            "used": {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 300},
        }
        # OpenAI API: same policy
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {cred}"},
            json={"model": "m", "messages": [{"role": "user", "content": "yo"}], "temperature": 0.2},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert engine.requests[-1]["sampling_params"]["temperature"] == 0.7
        rec = list(srv.proxy.executions[eid].records.tree.records())[-1]
        assert rec.metadata["sampling"]["asked"]["temperature"] == 0.2
        assert rec.metadata["sampling"]["used"]["temperature"] == 0.7


def test_refuse_names_the_parameter_and_accepts_the_runs_values(tok_dir, tmp_path, engine):
    with _server(tok_dir, tmp_path, engine, sampling_policy="refuse") as srv:
        eid, cred = srv.register("refuse")
        r = _anthropic(srv.url, cred, temperature=1.0, top_p=0.9)
        assert r.status_code == 400
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith(
            "top_p: this run samples with top_p=1.0, the request asked for 0.9"
        )
        assert engine.requests == [] and len(srv.proxy.executions[eid].records.tree) == 0
        r = _anthropic(srv.url, cred, temperature=1, top_k=-1)
        assert r.status_code == 200, r.text
        assert engine.requests[-1]["sampling_params"]["temperature"] == 1.0


def test_pass_keeps_the_harness_values(tok_dir, tmp_path, engine):
    with _server(tok_dir, tmp_path, engine, sampling_policy="pass") as srv:
        eid, cred = srv.register("pass")
        assert _anthropic(srv.url, cred, temperature=0.3, top_p=0.9, top_k=5).status_code == 200
        sp = engine.requests[-1]["sampling_params"]
        assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (0.3, 0.9, 5)
        (rec,) = srv.proxy.executions[eid].records.tree.records()
        assert rec.metadata["sampling"]["used"] == {
            "temperature": 0.3,
            "top_p": 0.9,
            "top_k": 5,
            "max_tokens": 300,
        }


def test_max_tokens_is_clamped_to_the_room_left(tok_dir, tmp_path, engine):
    with _server(tok_dir, tmp_path, engine, max_context_tokens=1000) as srv:
        eid, cred = srv.register("clamp")
        r = _anthropic(srv.url, cred, max_tokens=64000, content="word " * 100)
        assert r.status_code == 200, r.text
        prompt = len(engine.requests[-1]["input_ids"])
        assert 100 < prompt < 1000
        assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 1000 - prompt
        (rec,) = srv.proxy.executions[eid].records.tree.records()
        assert rec.metadata["sampling"]["asked"]["max_tokens"] == 64000
        assert rec.metadata["sampling"]["used"]["max_tokens"] == 1000 - prompt
        # a prompt that fills the context is refused in Anthropic's exact words
        r = _anthropic(srv.url, cred, max_tokens=10, content="word " * 1500)
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert msg.startswith("prompt is too long: ") and msg.endswith(" tokens > 1000 maximum")


def test_max_tokens_refused_in_anthropics_words(tok_dir, tmp_path, engine):
    with _server(tok_dir, tmp_path, engine, max_context_tokens=1000, context_overflow="refuse") as srv:
        _, cred = srv.register("refuse-ctx")
        r = _anthropic(srv.url, cred, max_tokens=64000, content="word " * 100)
        assert r.status_code == 400
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith("input length and `max_tokens` exceed context limit: ")
        assert err["error"]["message"].endswith(
            " + 64000 > 1000, decrease input length or `max_tokens` and try again"
        )
        assert engine.requests == []
