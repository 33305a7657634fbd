"""Issue 15 regressions for the proxy: damaged state is quarantined per execution, bad ids are 4xx, and the
request-controlled splice marker, admin bodies and engine answers cannot corrupt records or freeze the proxy."""

from __future__ import annotations

import httpx
import pytest

from gyre_tito.proxy import Proxy, ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
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


@pytest.fixture(scope="module")
def engine(tok_dir):
    rules = [ScriptRule(last_contains=["<tool_response>"], reply="finished " * 3), ScriptRule(reply=CALL)]
    e = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=rules))
    e.start()
    yield e
    e.stop()


def _cfg(tok_dir, tmp_path, urls, **kw):
    return ProxyConfig(
        engines=urls, tokenizer=str(tok_dir), store=str(tmp_path / "store"), admin_token="adm", **kw
    )


def _msg(url, cred, messages, **kw):
    body = {"model": "m", "max_tokens": 300, "messages": messages, "tools": TOOLS, **kw}
    return httpx.post(url + "/v1/messages", headers={"x-api-key": cred}, json=body, timeout=30)


def _two_calls(srv, cred, task="go"):
    msgs = [{"role": "user", "content": task}]
    use = _msg(srv.url, cred, msgs).json()["content"][0]
    msgs += [
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]},
    ]
    assert _msg(srv.url, cred, msgs).status_code == 200
    return msgs


def test_a_flipped_byte_quarantines_one_execution_not_the_proxy(tok_dir, tmp_path, engine):
    """Before: one damaged record log stopped the proxy from starting, taking every execution down."""
    cfg = _cfg(tok_dir, tmp_path, [engine.url])
    creds = {}
    with ProxyServer(cfg) as srv:
        for i in range(4):
            eid, creds[f"e{i}"] = srv.register(f"e{i}")
            _two_calls(srv, creds[eid])
        srv.admin("POST", "/admin/executions/e3/end")
    log = tmp_path / "store" / "records" / "e1.tito.jsonl"
    data = bytearray(log.read_bytes())
    data[40] ^= 0x01  # inside the first of two records: not a torn tail
    log.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in (tmp_path / "store" / "records").iterdir()}
    with ProxyServer(cfg) as srv:
        assert sorted(srv.proxy.quarantined) == ["e1"]
        assert srv.proxy.loaded_executions() == ["e0", "e2"]
        assert _msg(srv.url, creds["e0"], [{"role": "user", "content": "more"}]).status_code == 200
        r = _msg(srv.url, creds["e1"], [{"role": "user", "content": "more"}])
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert (
            "quarantined" in r.json()["error"]["message"] and "e1.tito.jsonl" in r.json()["error"]["message"]
        )
        r = srv.admin("GET", "/admin/executions/e1")
        assert r.status_code == 409 and "quarantined" in r.json()["error"]["message"]
        assert srv.admin("POST", "/admin/executions/e1/export", {}).status_code == 409
        q = srv.admin("GET", "/admin/quarantine").json()["quarantined"]
        assert [x["execution_id"] for x in q] == ["e1"] and "damaged record" in q[0]["reason"]
        assert srv.admin("GET", "/health").json()["quarantined"] == 1
        assert srv.admin("POST", "/admin/executions", {"execution_id": "e1"}).status_code == 409
    after = {p.name: p.read_bytes() for p in (tmp_path / "store" / "records").iterdir()}
    assert after["e1.tito.jsonl"] == before["e1.tito.jsonl"]  # left exactly as found, for repair


def test_an_ended_executions_damaged_log_is_a_409_on_export(tok_dir, tmp_path, engine):
    with ProxyServer(_cfg(tok_dir, tmp_path, [engine.url])) as srv:
        _, cred = srv.register("e")
        _two_calls(srv, cred)
        srv.admin("POST", "/admin/executions/e/end")
        log = tmp_path / "store" / "records" / "e.tito.jsonl"
        data = bytearray(log.read_bytes())
        data[40] ^= 0x01
        log.write_bytes(bytes(data))
        r = srv.admin("POST", "/admin/executions/e/export", {})
        assert r.status_code == 409 and "record log unreadable" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "eid",
    ["x" * 300, "%" * 90, "a\nb", "a\x00b", "..", ""],
)
def test_unusable_execution_ids_are_400_and_leave_no_registry_entry(tok_dir, tmp_path, engine, eid):
    """Before: a 300-character id gave a 500 and left a registry entry that stopped the proxy from restarting."""
    cfg = _cfg(tok_dir, tmp_path, [engine.url])
    with ProxyServer(cfg) as srv:
        r = srv.admin("POST", "/admin/executions", {"execution_id": eid})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = srv.admin("POST", "/admin/executions", {"execution_id": "ok", "group_id": "g" * 300})
        assert r.status_code == 400 and "group_id" in r.json()["error"]["message"]
        srv.register("fine")
    registry = (tmp_path / "store" / "executions.jsonl").read_text().splitlines()
    assert len(registry) == 1 and '"fine"' in registry[0]
    with ProxyServer(cfg) as srv:
        assert srv.proxy.loaded_executions() == ["fine"] and not srv.proxy.quarantined


def test_a_registry_entry_that_cannot_be_opened_is_quarantined(tok_dir, tmp_path, engine):
    """An old registry line with an id the filesystem refuses (written before ids were checked) is quarantined."""
    import orjson

    cfg = _cfg(tok_dir, tmp_path, [engine.url])
    with ProxyServer(cfg) as srv:
        srv.register("good")
    with open(tmp_path / "store" / "executions.jsonl", "ab") as f:
        bad = {"ev": "register", "execution_id": "x" * 300, "group_id": "g", "credential_sha256": "0" * 64}
        f.write(orjson.dumps(bad) + b"\n" + b"[1, 2]\n" + b"{not json\n")
    proxy = Proxy(cfg)
    try:
        assert proxy.loaded_executions() == ["good"] and list(proxy.quarantined) == ["x" * 300]
    finally:
        proxy.records.close()


@pytest.mark.parametrize(
    "text", ["\ue000R", "look: \ue000R0\ue001 here", "\ue000R99\ue001", "\ue000\ue001\ue000R"]
)
def test_private_use_marker_text_is_ordinary_text(tok_dir, tmp_path, engine, text):
    """Before: `\\ue000R` anywhere in a message gave a 500 on every later call; `\\ue000R0\\ue001` was replaced by an
    earlier recorded output, flagged as policy tokens."""
    from gyre_tito.types import mask_from_runs

    with ProxyServer(_cfg(tok_dir, tmp_path, [engine.url])) as srv:
        eid, cred = srv.register("e")
        msgs = _two_calls(srv, cred)
        msgs = [*msgs, {"role": "assistant", "content": "noted"}, {"role": "user", "content": text}]
        r = _msg(srv.url, cred, msgs)
        assert r.status_code == 200, r.text
        tree = srv.proxy.executions[eid].records.tree
        recs = {rec.call_id: rec for rec in tree.records()}
        first = next(rec for rec in recs.values() if rec.seq == 0)
        leaf = next(rec for rec in recs.values() if rec.seq == 2)
        path, node = [], leaf
        while node is not None:
            path.append(node)
            node = recs.get(node.parent_id) if node.parent_id else None
        assert path[-1] is first  # the recorded tool use was matched as the path (its output is the parent's)
        # no recorded output was spliced anywhere else into the context: no policy-marked input token at all
        assert sum(mask_from_runs(rec.input_provenance).count(True) for rec in path) == 0
        assert text in srv.proxy.chat.decode(leaf.input_ids)
        more = [*msgs, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
        assert _msg(srv.url, cred, more).status_code == 200  # nothing poisoned the execution


def test_a_large_body_never_stalls_the_proxy(tok_dir, tmp_path, engine):
    """Before: tokenizing ran on the event loop before the length check: a 3.7 MB body froze every call and /health
    for 15.6 s. Now the body is capped (413), a prompt that cannot fit is refused from its byte length alone, and
    tokenizing runs in a worker thread. Proven by construction, not by a clock: the big call's encoding is held at a
    gate inside its worker thread while /health and other executions' calls are answered (were it on the event loop,
    they could not be, and the test would hang at the gate). The speed of the worker path is a benchmark's matter."""
    import threading

    big = "hello world " * 300_000  # 3.6 MB, ~600k tokens with the tiny tokenizer
    with ProxyServer(_cfg(tok_dir, tmp_path, [engine.url])) as srv:
        _, cred = srv.register("a")
        tokenized = []
        encode_rendered = srv.proxy.chat.encode_rendered
        srv.proxy.chat.encode_rendered = lambda *a, **k: tokenized.append(1) or encode_rendered(*a, **k)
        r = _msg(srv.url, cred, [{"role": "user", "content": big}])
        assert r.status_code == 400 and "at least" in r.json()["error"]["message"]
        assert tokenized == []  # refused from its length, before any tokenizing
        r = _msg(srv.url, cred, [{"role": "user", "content": "x" * (5 << 20)}])
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # a limit the byte-length bound cannot decide (>= 277k, < 600k tokens): the text must really be tokenized (then
    # refused, so the in-process scripted engine never has to chew on it); the loop and other executions keep going
    with ProxyServer(_cfg(tok_dir, tmp_path / "2", [engine.url], max_context_tokens=400_000)) as srv:
        _, cred_a = srv.register("a")
        _, cred_b = srv.register("b")
        held, release = threading.Event(), threading.Event()
        encode = srv.proxy.encode

        def gated_encode(ex, conv, limit):
            if ex.id == "a":  # the big call waits at the gate, in its worker thread
                assert threading.current_thread() is not threading.main_thread()
                held.set()
                assert release.wait(120), "the test never released the gate"
            return encode(ex, conv, limit)

        srv.proxy.encode = gated_encode
        out = {}
        th = threading.Thread(
            target=lambda: out.update(r=_msg(srv.url, cred_a, [{"role": "user", "content": big}]))
        )
        th.start()
        assert held.wait(120), "the big call never reached its encoding"
        # the big call is now mid-encoding: the proxy still answers everyone else
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        for k in range(3):
            small = _msg(srv.url, cred_b, [{"role": "user", "content": f"small {k}"}])
            assert small.status_code == 200 and small.json()["content"], small.text
        assert th.is_alive() and "r" not in out  # still held: the answers above did not wait for it
        release.set()
        th.join()
        assert out["r"].status_code == 400 and "600" in out["r"].json()["error"]["message"]


def test_proxy_memory_is_bounded_by_live_executions(tok_dir, tmp_path, engine):
    """Before: parsed messages and encodings of every unique prompt text stayed cached after their executions ended
    (400 unique 120 KB messages took RSS from 139 to 727 MB)."""
    budget = 1 << 20
    with ProxyServer(_cfg(tok_dir, tmp_path, [engine.url], encode_cache_bytes=budget)) as srv:
        for e in range(4):
            eid, cred = srv.register(f"e{e}")
            for k in range(5):
                text = f"{e}-{k} " + "lorem ipsum dolor sit amet " * 4500  # ~120 KB, unique
                assert (
                    _msg(srv.url, cred, [{"role": "user", "content": text}], max_tokens=5).status_code == 200
                )
            ex = srv.proxy.executions[eid]
            assert ex.turn_cache.nbytes <= ex.turn_cache.max_bytes
            srv.admin("POST", f"/admin/executions/{eid}/end")
            assert eid not in srv.proxy.executions  # its tree and its turn cache left memory
        assert srv.proxy.chat.cache_bytes() <= 2 * budget
        assert not hasattr(srv.proxy, "turn_cache")  # no proxy-wide cache of parsed messages any more
