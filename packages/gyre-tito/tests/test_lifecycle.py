"""Ended executions leave memory (summary only, tree reloaded from the log on demand) and export path confinement."""

import threading

import httpx
import pytest

from gyre_tito.execution import EndedExecution
from gyre_tito.export import read_jsonl
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
EXPORT = {"j_max": 5, "seed": 3, "include_other": True}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _engine(tok_dir, delay=0.0):
    rules = [ScriptRule(last_contains=["<tool_response>"], reply="finished " * 30), ScriptRule(reply=CALL)]
    return ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=rules, token_delay_s=delay))


@pytest.fixture
def engine_url(tok_dir):
    e = _engine(tok_dir)
    yield e.start()
    e.stop()


def _cfg(tok_dir, tmp_path, url, **kw):
    return ProxyConfig(
        engines=[url], tokenizer=str(tok_dir), store=str(tmp_path / "store"), admin_token="adm", **kw
    )


def _msg(url, cred, messages):
    body = {"model": "m", "max_tokens": 300, "messages": messages, "tools": TOOLS}
    return httpx.post(url + "/v1/messages", headers={"x-api-key": cred}, json=body, timeout=30)


def _run(srv, cred, task):
    """Two calls (tool use, then the answer after its result) plus a diverging branch: a three-node tree."""
    msgs = [{"role": "user", "content": task}]
    a = _msg(srv.url, cred, msgs).json()
    use = a["content"][0]
    msgs += [
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]},
    ]
    assert _msg(srv.url, cred, msgs).status_code == 200
    assert _msg(srv.url, cred, [{"role": "user", "content": task + " again"}]).status_code == 200


def _export(srv, eid, **kw):
    r = srv.admin("POST", f"/admin/executions/{eid}/export", EXPORT | kw)
    assert r.status_code == 200, r.text
    return r.json()["trajectories"]


def _assert_ended_401(srv, cred):
    r = _msg(srv.url, cred, [{"role": "user", "content": "more"}])
    assert r.status_code == 401
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    assert "has ended" in r.json()["error"]["message"]
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {cred}"},
        json={"model": "m", "messages": [{"role": "user", "content": "more"}]},
        timeout=30,
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_ended_execution_is_unloaded_and_exports_the_same(tok_dir, tmp_path, engine_url):
    with ProxyServer(_cfg(tok_dir, tmp_path, engine_url)) as srv:
        e1, c1 = srv.register("e1", group_id="g")
        _, c2 = srv.register("e2", group_id="g")
        _run(srv, c1, "task one")
        _run(srv, c2, "task two")
        before = _export(srv, e1)
        assert len(before) >= 2 and all(t["execution_id"] == "e1" for t in before)
        assert srv.proxy.loaded_executions() == ["e1", "e2"]

        r = srv.admin("POST", f"/admin/executions/{e1}/end")
        assert r.status_code == 200 and r.json()["ended"] is True and r.json()["calls"] == 3
        assert srv.proxy.loaded_executions() == ["e2"]
        summary = srv.proxy.get(e1)
        assert isinstance(summary, EndedExecution) and not hasattr(summary, "records")
        assert summary.group_id == "g" and summary.calls == 3 and summary.log_path.is_file()

        assert _export(srv, e1) == before  # reloaded read-only from the log ...
        assert srv.proxy.loaded_executions() == ["e2"]  # ... and not kept
        out = tmp_path / "store" / "exports" / "traj" / "e1.jsonl"
        assert _export(srv, e1, path=str(out)) == before
        assert [t.token_ids for t in read_jsonl(out)] == [t["token_ids"] for t in before]
        info = srv.admin("GET", f"/admin/executions/{e1}").json()
        assert info == {
            "execution_id": "e1",
            "group_id": "g",
            "ended": True,
            "calls": 3,
            "route": None,
            "active_calls": 0,
        }
        _assert_ended_401(srv, c1)
        assert srv.admin("POST", f"/admin/executions/{e1}/end").status_code == 200  # idempotent
        assert srv.admin("POST", "/admin/executions", {"execution_id": "e1"}).status_code == 409
        # e2 unaffected
        assert _msg(srv.url, c2, [{"role": "user", "content": "task two"}]).status_code == 200
        metrics = srv.admin("GET", "/metrics").text
        assert 'gyre_tito_executions{state="ended"} 1' in metrics
        assert 'gyre_tito_executions{state="active"} 1' in metrics


def test_restart_loads_no_ended_tree(tok_dir, tmp_path, engine_url):
    cfg = _cfg(tok_dir, tmp_path, engine_url)
    ended, before = {}, {}
    with ProxyServer(cfg) as srv:
        for i in range(4):
            eid, cred = srv.register(f"done-{i}")
            _run(srv, cred, f"task {i}")
            before[eid] = _export(srv, eid)
            assert srv.admin("POST", f"/admin/executions/{eid}/end").status_code == 200
            ended[eid] = cred
        _, live_cred = srv.register("live")
        msgs = [{"role": "user", "content": "go"}]
        use = _msg(srv.url, live_cred, msgs).json()["content"][0]
    with ProxyServer(cfg) as srv2:
        assert srv2.proxy.loaded_executions() == ["live"]
        assert all(srv2.proxy.ended[e].calls is None for e in ended)  # not even their logs were read
        for eid, cred in ended.items():
            _assert_ended_401(srv2, cred)
            assert srv2.admin("GET", f"/admin/executions/{eid}").json()["calls"] == 3
            assert _export(srv2, eid) == before[eid]
        assert srv2.proxy.loaded_executions() == ["live"]
        msgs += [
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]},
        ]
        assert _msg(srv2.url, live_cred, msgs).status_code == 200  # the live one kept its tree and tool cache
        recs = list(srv2.proxy.executions["live"].records.tree.records())
        assert len(recs) == 2 and recs[1].parent_id == recs[0].call_id


def test_end_during_a_call_cancels_it_then_unloads(tok_dir, tmp_path):
    """The runner ends an execution once its harness is gone (it exited or was killed at its timeout): a call still
    in flight has no reader left, so it is cancelled (409), never recorded after the execution's end, and the tree
    leaves memory once the call has returned."""
    eng = _engine(tok_dir, delay=0.02)
    try:
        with ProxyServer(_cfg(tok_dir, tmp_path, eng.start())) as srv:
            eid, cred = srv.register("slow")
            result = {}
            t = threading.Thread(
                target=lambda: result.update(r=_msg(srv.url, cred, [{"role": "user", "content": "x"}]))
            )
            t.start()
            while not srv.proxy.executions[eid].inflight:
                t.join(0.01)
            assert srv.admin("POST", f"/admin/executions/{eid}/end").json()["ended"] is True
            t.join(30)
            assert result["r"].status_code == 409  # the call that was running was cancelled
            assert srv.proxy.loaded_executions() == []
            assert srv.admin("GET", f"/admin/executions/{eid}").json()["calls"] == 0
            _assert_ended_401(srv, cred)
    finally:
        eng.stop()


def test_export_path_is_confined_to_store_and_export_dirs(tok_dir, tmp_path, engine_url):
    extra = tmp_path / "exports"
    outside = tmp_path / "outside"
    outside.mkdir()
    (extra / "sub").mkdir(parents=True)
    (extra / "sub" / "link").symlink_to(outside)
    (extra / "file-link.jsonl").symlink_to(outside / "f.jsonl")
    with ProxyServer(_cfg(tok_dir, tmp_path, engine_url, export_dirs=[str(extra)])) as srv:
        eid, cred = srv.register("e")
        _run(srv, cred, "task")
        ok = [
            tmp_path / "store" / "exports" / "t" / "a.jsonl",
            extra / "new" / "b.parquet",
            extra / "sub" / ".." / "c.jsonl",
        ]
        for p in ok:
            assert len(_export(srv, eid, path=str(p))) >= 1
            assert p.resolve().is_file()
        bad = [
            outside / "x.jsonl",
            tmp_path / "store" / ".." / "escape.jsonl",
            extra / ".." / "outside" / "y.jsonl",
            extra / "sub" / "link" / "z.jsonl",  # a symlinked directory resolving outside
            extra / "file-link.jsonl",  # a symlinked file resolving outside
            tmp_path / "store",  # a root itself is not a file under it
            tmp_path
            / "store"
            / "t"
            / "a.jsonl",  # the store itself is not an export root, only STORE/exports
        ]
        for p in bad:
            r = srv.admin("POST", f"/admin/executions/{eid}/export", {"path": str(p)})
            assert r.status_code == 400, (p, r.text)
            err = r.json()["error"]
            assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"
            assert (
                str((tmp_path / "store" / "exports").resolve()) in err["message"]
                and str(extra.resolve()) in err["message"]
            )
        assert sorted(p.name for p in outside.iterdir()) == [] and not (tmp_path / "escape.jsonl").exists()
        for body in ({"path": 5}, {"path": str(extra / "d.csv")}):
            r = srv.admin("POST", f"/admin/executions/{eid}/export", body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert not (extra / "d.csv").exists()


def test_export_never_overwrites_the_proxys_own_files(tok_dir, tmp_path, engine_url):
    """Before: a `path` inside the store (executions.jsonl, records/<id>.tito.jsonl) overwrote the proxy's own files;
    after a restart it had 0 executions or refused to start."""
    store = tmp_path / "store"
    with ProxyServer(_cfg(tok_dir, tmp_path, engine_url)) as srv:
        eid, cred = srv.register("e")
        _run(srv, cred, "task")
        own = [store / "executions.jsonl", store / "records" / "e.tito.jsonl", store / "config.json"]
        before = {p: p.read_bytes() for p in own if p.exists()}
        assert len(before) >= 2
        sneaky = tmp_path / "link.jsonl"
        sneaky.symlink_to(store / "records" / "e.tito.jsonl")
        (store / "exports").mkdir()
        (store / "exports" / "rec.jsonl").symlink_to(store / "records" / "e.tito.jsonl")
        for p in [
            store / "executions.jsonl",
            store / "records" / "e.tito.jsonl",
            store / "records" / "new.jsonl",
            store / "exports" / ".." / "executions.jsonl",
            store / "exports" / "rec.jsonl",  # a link in the export root pointing at a record log
            sneaky,
        ]:
            r = srv.admin("POST", f"/admin/executions/{eid}/export", {"path": str(p)})
            assert r.status_code == 400, (p, r.text)
        assert {p: p.read_bytes() for p in before} == before
        assert not (store / "records" / "new.jsonl").exists()
    with ProxyServer(_cfg(tok_dir, tmp_path, engine_url)) as srv:  # restarts with its execution and tree
        assert srv.proxy.calls("e") == 3


def test_an_export_dir_overlapping_the_store_is_refused(tok_dir, tmp_path, engine_url):
    for d in (tmp_path, tmp_path / "store", tmp_path / "store" / "records" / "x"):
        with pytest.raises(ValueError, match="overlaps the proxy's own state"):
            Proxy(_cfg(tok_dir, tmp_path, engine_url, export_dirs=[str(d)]))
