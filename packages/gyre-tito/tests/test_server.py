import asyncio
import json
import threading
import time

import httpx
import pytest

from gyre_tito.proxy import Proxy, ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule, scripted_logprob
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
TOOLS = [
    {
        "name": "Bash",
        "description": "run",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def engines(tok_dir):
    rules = [ScriptRule(last_contains=["<tool_response>"], reply="finished " * 30), ScriptRule(reply=CALL)]
    es = [
        ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=rules, weight_version=f"w{i}"))
        for i in range(2)
    ]
    urls = [e.start() for e in es]
    yield es, urls
    for e in es:
        e.stop()


def _cfg(tok_dir, tmp_path, urls, **kw):
    return ProxyConfig(
        engines=urls, tokenizer=str(tok_dir), store=str(tmp_path / "store"), admin_token="adm", **kw
    )


def _msg(url, cred, messages, **kw):
    body = {"model": "m", "max_tokens": 300, "messages": messages, "tools": TOOLS, **kw}
    return httpx.post(url + "/v1/messages?beta=true", headers={"x-api-key": cred}, json=body, timeout=30)


def test_auth_admin_and_basic_endpoints(tok_dir, tmp_path, engines):
    _, urls = engines
    with ProxyServer(_cfg(tok_dir, tmp_path, urls[:1])) as srv:
        # the admin token and bodies of every admin route: test_admin_api
        _eid, cred = srv.register("e1")
        assert srv.admin("POST", "/admin/executions", {"execution_id": "e1"}).status_code == 409
        r = _msg(srv.url, "wrong", [{"role": "user", "content": "x"}])
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(
            srv.url + "/v1/messages",
            headers={"Authorization": f"Bearer {cred}"},
            json={
                "model": "m",
                "max_tokens": 100,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": TOOLS,
            },
        )
        assert r.status_code == 200 and r.json()["content"][0]["type"] == "tool_use"
        r = httpx.post(
            srv.url + "/v1/messages/count_tokens",
            headers={"x-api-key": cred},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
        )
        assert r.status_code == 200 and r.json()["input_tokens"] > 50
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "gyre-policy"
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        m = srv.admin("GET", "/metrics").text
        assert (
            "gyre_tito_calls_total 1" in m and 'gyre_tito_requests_total{api="anthropic",status="401"} 1' in m
        )
        info = srv.admin("GET", "/admin/executions/e1").json()
        assert info["calls"] == 1 and not info["ended"]
        assert srv.admin("GET", "/admin/executions/nope").status_code == 404


def test_context_limit_and_no_engine_are_protocol_errors(tok_dir, tmp_path, engines):
    _, urls = engines
    cfg = _cfg(tok_dir, tmp_path, urls[:1], max_context_tokens=1000)
    cfg.engine.max_attempts = 2
    cfg.engine.retry_backoff_s = 0.01
    with ProxyServer(cfg) as srv:
        _, cred = srv.register()
        r = _msg(srv.url, cred, [{"role": "user", "content": "word " * 1500}])
        assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"]
        eid, cred = srv.register(route=["http://127.0.0.1:9"])  # nothing listens there
        r = _msg(srv.url, cred, [{"role": "user", "content": "hi"}])
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
        assert len(srv.proxy.executions[eid].records.tree) == 0


def test_restart_reloads_executions_tree_and_tool_cache(tok_dir, tmp_path, engines):
    _, urls = engines
    cfg = _cfg(tok_dir, tmp_path, urls[:1])
    with ProxyServer(cfg) as srv:
        eid, cred = srv.register("keep")
        msgs = [{"role": "user", "content": "go"}]
        a = _msg(srv.url, cred, msgs).json()
        first_id = srv.proxy.executions[eid].records.tree.nodes[0].call_id
    with ProxyServer(cfg) as srv2:  # a fresh process on the same store
        use = a["content"][0]
        msgs += [
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]},
        ]
        r = _msg(srv2.url, cred, msgs)
        assert r.status_code == 200, r.text
        recs = list(srv2.proxy.executions[eid].records.tree.records())
        assert len(recs) == 2 and recs[1].parent_id == first_id
        srv2.admin("POST", f"/admin/executions/{eid}/end")
    with ProxyServer(cfg) as srv3:
        assert _msg(srv3.url, cred, [{"role": "user", "content": "x"}]).status_code == 401


def test_drain_aborts_and_continues_on_other_engine(tok_dir, tmp_path, engines):
    es, urls = engines
    for e in es:
        e.config.hold_after = 5  # gate: the first attempt stops after 5 tokens until drained (aborted)
    with ProxyServer(_cfg(tok_dir, tmp_path, urls)) as srv:
        eid, cred = srv.register()
        for e in es:
            e.release.set()  # the first call runs through
        first = _msg(srv.url, cred, [{"role": "user", "content": "go"}]).json()["content"][0]
        for e in es:
            e.release.clear()
            e.holding.clear()
        msgs = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [first]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": first["id"], "content": "ok"}],
            },
        ]
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("r", _msg(srv.url, cred, msgs)))
        th.start()
        held = _wait_any_holding(es)
        busy = urls[es.index(held)].rstrip("/")
        r = srv.admin("POST", "/admin/engines/drain", {"engine": busy})
        assert r.status_code == 200 and r.json()["inflight_at_drain"] == 1
        th.join(30)
        assert (
            out["r"].status_code == 200
            and out["r"].json()["content"][0]["text"] == ("finished " * 30).strip()
        )
        rec = list(srv.proxy.executions[eid].records.tree.records())[-1]
        other = next(u for u in urls if u.rstrip("/") != busy).rstrip("/")
        assert [s.engine_id for s in rec.output_segments] == [busy, other]
        assert (rec.output_segments[0].start, rec.output_segments[0].end) == (0, 5)  # exactly the held prefix
        assert rec.output_logprobs == [scripted_logprob(i, t) for i, t in enumerate(rec.output_ids)]
        assert busy not in [e["url"] for e in srv.proxy.pool.engines()]


def _wait_any_holding(es, timeout=20.0):
    """The engine whose request reached its hold gate (an event, not a timing guess)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in es:
            if e.holding.wait(0.01):
                return e
    raise AssertionError("no request reached the hold gate")


def _call_held_on_first_engine(srv, es, urls):
    """A new execution routed to engine 0, its first call running in a thread and held there (`hold_after`):
    (execution id, the thread, where the thread puts the response under "r")."""
    eid, cred = srv.register()
    assert srv.admin("PUT", f"/admin/executions/{eid}/route", {"engines": [urls[0]]}).status_code == 200
    out = {}
    th = threading.Thread(
        target=lambda: out.setdefault("r", _msg(srv.url, cred, [{"role": "user", "content": "go"}]))
    )
    th.start()
    assert es[0].holding.wait(20)
    return eid, th, out


def test_interrupted_call_continues_on_the_executions_new_route(tok_dir, tmp_path, engines):
    """A cell leaving rollout: the controller reroutes the execution, then drains its engine. The interrupted call
    must continue on the new route, not go back to the drained engine once the pool has forgotten it."""
    es, urls = engines
    es[0].config.hold_after = 3  # gate: the call holds on engine 0 after 3 tokens
    with ProxyServer(_cfg(tok_dir, tmp_path, urls)) as srv:
        eid, th, out = _call_held_on_first_engine(srv, es, urls)
        assert srv.admin("PUT", f"/admin/executions/{eid}/route", {"engines": [urls[1]]}).status_code == 200
        assert srv.admin("POST", "/admin/engines/drain", {"engine": urls[0]}).status_code == 200
        th.join(30)
        assert out["r"].status_code == 200
        rec = list(srv.proxy.executions[eid].records.tree.records())[-1]
        assert [s.engine_id for s in rec.output_segments] == [urls[0].rstrip("/"), urls[1].rstrip("/")]
        assert (rec.output_segments[0].start, rec.output_segments[0].end) == (0, 3)
        assert len(es[0].requests) == 1  # the drained engine was never called again


def test_ending_an_execution_cancels_its_call_in_flight(tok_dir, tmp_path, engines):
    """A harness killed at its timeout while an engine never answers its call: the runner ends the execution, and the
    call must end there, not wait on the engine or be retried on the next one when the first is drained."""
    es, urls = engines
    es[
        0
    ].config.hold_after = (
        3  # gate: the call holds on engine 0 after 3 tokens (an engine that stopped answering)
    )
    with ProxyServer(_cfg(tok_dir, tmp_path, urls)) as srv:
        eid, th, out = _call_held_on_first_engine(srv, es, urls)
        assert srv.admin("POST", f"/admin/executions/{eid}/end").status_code == 200
        th.join(30)
        assert out["r"].status_code == 409 and "ended while this call was in flight" in out["r"].text
        assert len(es[0].requests) == 1 and es[1].requests == []  # never retried elsewhere
        assert all(e["inflight"] == 0 for e in srv.proxy.pool.engines())  # the engine's request is gone too
        assert eid not in srv.proxy.executions  # unloaded once its call returned
        assert srv.admin("POST", "/admin/engines/drain", {"engine": urls[0]}).json()["inflight_at_drain"] == 0
        assert es[1].requests == []


def test_per_execution_route_and_least_loaded(tok_dir, tmp_path, engines):
    es, urls = engines
    with ProxyServer(_cfg(tok_dir, tmp_path, urls)) as srv:
        eid, cred = srv.register()
        assert srv.admin("PUT", f"/admin/executions/{eid}/route", {"engines": [urls[1]]}).status_code == 200
        for _ in range(2):
            assert _msg(srv.url, cred, [{"role": "user", "content": "go"}]).status_code == 200
        assert len(es[1].requests) == 2 and len(es[0].requests) == 0
        segs = [r.output_segments[0].weight_version for r in srv.proxy.executions[eid].records.tree.records()]
        assert segs == ["w1", "w1"]

    pool = Proxy(_cfg(tok_dir, tmp_path / "p2", urls)).pool
    pool._engines[urls[0]].inflight["x"] = 0  # engine 0 is busy: the least-loaded pick is engine 1
    assert pool._pick(None).url == urls[1]
    asyncio.run(pool.aclose())


def test_response_split_into_two_assistant_messages_is_spliced_once(tok_dir, tmp_path, engines):
    _, urls = engines
    with ProxyServer(_cfg(tok_dir, tmp_path, urls[:1])) as srv:
        eid, cred = srv.register()
        first = _msg(srv.url, cred, [{"role": "user", "content": "go"}]).json()["content"][0]
        msgs = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "text", "text": ""}, first]},
            {"role": "assistant", "content": [first]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": first["id"], "content": "ok"}],
            },
        ]
        assert _msg(srv.url, cred, msgs).status_code == 200
        recs = list(srv.proxy.executions[eid].records.tree.records())
        assert recs[1].parent_id == recs[0].call_id and len(recs[1].input_ids) < 40


def test_thinking_off_generation_prompt_is_restored_before_recorded_output(tok_dir, tmp_path, engines):
    _, urls = engines
    with ProxyServer(_cfg(tok_dir, tmp_path, urls[:1])) as srv:
        assert srv.proxy.chat.generation_suffix(enable_thinking=False) == "<think>\n\n</think>\n\n"
        assert srv.proxy.chat.generation_suffix() == ""
        eid, cred = srv.register()
        off = {"thinking": {"type": "disabled"}}
        first = _msg(srv.url, cred, [{"role": "user", "content": "go"}], **off).json()["content"][0]
        msgs = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [first]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": first["id"], "content": "ok"}],
            },
        ]
        assert _msg(srv.url, cred, msgs, **off).status_code == 200
        recs = list(srv.proxy.executions[eid].records.tree.records())
        assert recs[1].parent_id == recs[0].call_id and len(recs[1].input_ids) < 40


def test_engine_rejection_is_a_400_not_a_retry_storm(tok_dir, tmp_path):
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), context_length=50))
    url = eng.start()
    try:
        with ProxyServer(_cfg(tok_dir, tmp_path, [url], context_from_engines=False)) as srv:
            eid, cred = srv.register()
            r = _msg(srv.url, cred, [{"role": "user", "content": "hi"}])
            assert (
                r.status_code == 400
                and "longer than the model's context length" in r.json()["error"]["message"]
            )
            assert srv.proxy.pool.retries == 0 and len(srv.proxy.executions[eid].records.tree) == 0
    finally:
        eng.stop()


def _frames(resp: httpx.Response) -> list[tuple[str, dict]]:
    out = []
    for block in resp.text.split("\n\n"):
        if block.startswith("event: "):
            head, data = block.split("\n", 1)
            out.append((head[7:], json.loads(data[6:])))
    return out


def test_stream_starts_at_once_pings_while_generating_and_reports_late_errors(tok_dir, tmp_path):
    import openai  # slow to import: not at collection

    eng = ScriptedEngine(
        ScriptedEngineConfig(tokenizer=str(tok_dir), default_reply="slow " * 6, hold_after=2)
    )
    url = eng.start()
    dying = ScriptedEngine(
        ScriptedEngineConfig(tokenizer=str(tok_dir), default_reply="slow " * 6, fail_after=2)
    )
    dying_url = dying.start()
    try:
        cfg = _cfg(tok_dir, tmp_path, [url], keepalive_s=0.05)
        cfg.engine.max_attempts = 2
        cfg.engine.retry_backoff_s = 0.01
        with ProxyServer(cfg) as srv:
            eid, cred = srv.register()
            body = {
                "model": "m",
                "max_tokens": 300,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            }
            kinds = []
            with httpx.stream(
                "POST", srv.url + "/v1/messages", headers={"x-api-key": cred}, json=body, timeout=30
            ) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        kinds.append(line[7:])
                        if kinds[-1] == "ping":
                            eng.release.set()  # gate: the engine holds until the harness has seen a keep-alive
            assert kinds[0] == "message_start" and "ping" in kinds and kinds[-1] == "message_stop"
            assert kinds[kinds.index("content_block_start") :] == [
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
            assert len(srv.proxy.executions[eid].records.tree) == 1
            # an engine failure after the engine accepted the call arrives as an error event in Anthropic's shape
            _, cred2 = srv.register(route=[dying_url])
            r = _msg(srv.url, cred2, [{"role": "user", "content": "hi"}], stream=True)
            frames = _frames(r)
            assert r.status_code == 200 and frames[0][0] == "message_start" and frames[-1][0] == "error"
            assert frames[-1][1] == {
                "type": "error",
                "error": {"type": "overloaded_error", "message": frames[-1][1]["error"]["message"]},
            }
            # OpenAI: keep-alive comments are invisible to the SDK
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key=cred)
            chunks = list(
                client.chat.completions.create(
                    model="p", messages=[{"role": "user", "content": "x"}], stream=True
                )
            )
            assert (
                "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                == ("slow " * 6).strip()
            )
    finally:
        eng.stop()
        dying.stop()


def test_a_streamed_call_the_engine_rejects_is_an_http_400(tok_dir, tmp_path):
    """Before: the stream started before the engine saw the request, so its 400 came back as HTTP 200 + an error event."""
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), context_length=50))
    url = eng.start()
    try:
        with ProxyServer(_cfg(tok_dir, tmp_path, [url], context_from_engines=False)) as srv:
            _, cred = srv.register()
            long = "word " * 60
            r = _msg(srv.url, cred, [{"role": "user", "content": long}], stream=True)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            assert "context length" in r.json()["error"]["message"]
            r = httpx.post(
                srv.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {cred}"},
                json={"model": "m", "messages": [{"role": "user", "content": long}], "stream": True},
                timeout=30,
            )
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    finally:
        eng.stop()


def test_max_context_is_taken_from_the_engines(tok_dir, tmp_path):
    """Before: `--max-context` (131072) was the only limit, whatever the engine's context length."""
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), context_length=200))
    url = eng.start()
    try:
        with ProxyServer(_cfg(tok_dir, tmp_path, [url])) as srv:
            _, cred = srv.register()
            r = _msg(srv.url, cred, [{"role": "user", "content": "hi"}])  # the tools alone are ~220 tokens
            assert r.status_code == 400 and "> 200 maximum" in r.json()["error"]["message"], r.text
            assert len(eng.requests) == 0  # refused by the proxy, never sent
            body = {"model": "m", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": cred}, json=body, timeout=30)
            assert r.status_code == 200, r.text
            sent = eng.requests[-1]
            assert len(sent["input_ids"]) + sent["sampling_params"]["max_new_tokens"] <= 200
    finally:
        eng.stop()


def test_a_null_logprob_from_an_engine_is_never_recorded_as_zero(tok_dir, tmp_path):
    """Before: an engine with NaN weights sent `null` log-probs and the proxy recorded 0.0 (a certain token)."""
    from gyre_tito.engine_client import EnginePool, EnginePoolConfig, _apply, _Attempt

    att = _Attempt()
    with pytest.raises(ValueError, match="null or non-finite"):
        _apply(att, {"meta_info": {"output_token_logprobs": [[-0.5, 7, None], [None, 8, None]]}})
    assert att.ids == [] and att.logprobs == []

    class NullEngine(ScriptedEngine):
        def _answer(self, rid, ids, out, done, finish):
            ans = super()._answer(rid, ids, out, done, finish)
            for t in ans["meta_info"]["output_token_logprobs"]:
                t[0] = None
            return ans

    bad = NullEngine(ScriptedEngineConfig(tokenizer=str(tok_dir)))
    good = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir)))
    urls = [bad.start(), good.start()]
    try:
        import asyncio

        async def main():
            pool = EnginePool(EnginePoolConfig(engines=urls, retry_backoff_s=0.01))
            try:
                res = await pool.generate([1, 2, 3], {"max_new_tokens": 50}, route=[urls[0], urls[1]])
            finally:
                await pool.aclose()
            return res

        res = asyncio.run(main())
        assert res.segments[-1].engine == urls[1] and all(s.engine == urls[1] for s in res.segments)
        assert res.logprobs == [scripted_logprob(i, t) for i, t in enumerate(res.output_ids)]
    finally:
        bad.stop()
        good.stop()


def test_each_body_parses_only_its_new_bytes_and_bad_json_is_still_a_400(tok_dir, tmp_path, engines):
    _, urls = engines
    with ProxyServer(_cfg(tok_dir, tmp_path, urls[:1])) as srv:
        eid, cred = srv.register("grow")
        messages = [{"role": "user", "content": "list the files"}]
        ex = srv.proxy.get(eid)
        for i in range(3):
            r = _msg(srv.url, cred, messages)
            assert r.status_code == 200
            messages += [
                {"role": "assistant", "content": r.json()["content"]},
                {"role": "user", "content": f"{i}"},
            ]
            if i == 0:
                first = ex.request_history.recent[0].messages[0]
        last = ex.request_history.recent[0]
        assert len(last.messages) == 5 and last.messages == messages[:5]
        assert last.messages[0] is first  # parsed once: the later bodies parsed only their new bytes
        tree = ex.records.tree
        assert [n.parent for n in tree.nodes] == [-1, 0, 1]
        sent = json.dumps({"model": "m", "max_tokens": 300, "messages": messages, "tools": TOOLS}).encode()
        cut = sent.index(b'], "tools"')  # the messages' closing bracket
        bad = sent[:cut] + b",]" + sent[cut + 1 :]  # a trailing comma after the kept messages
        r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": cred}, content=bad, timeout=30)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
