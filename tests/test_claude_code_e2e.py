"""Acceptance 1: the real Claude Code CLI runs a multi-turn task through the TITO proxy on the scripted engine.

The script makes the main agent call Bash, Write, Bash, Write and finish. We assert the files the CLI wrote, the
execution's tree (exact token ids sent to the engine, output ids, log-probs, segments, provenance: tool results are
context, never targets) and the trajectory the admin API exports. The CLI binary comes from `npm ci` (package.json);
if it is missing this test fails, it does not skip.
"""

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from gyre_tito.proxy import ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule, scripted_logprob
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer, load_tiny_tokenizer
from gyre_tito.types import mask_from_runs

ROOT = Path(__file__).resolve().parents[1]
CLAUDE = ROOT / "node_modules" / ".bin" / "claude"


def _run_claude(base_url: str, credential: str, home: Path, cwd: Path, prompt: str, tools: str):
    """The real CLI in -p mode against the proxy, with the execution's credential and a private HOME."""
    env = dict(
        os.environ,
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY=credential,
        DISABLE_TELEMETRY="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        HOME=str(home),
    )
    env.pop("ANTHROPIC_AUTH_TOKEN", None)
    return subprocess.run(
        [str(CLAUDE), "-p", prompt, "--allowedTools", tools, "--output-format", "json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def _script(work: Path) -> list[str]:
    # Markers are computed by the shell ($((...))), so they appear in tool results, never in the calls themselves.
    return [
        _call(
            "Bash",
            {
                "command": "mkdir -p out && echo one > out/one.txt && echo STEP$((0+1))_OK",
                "description": "make",
            },
        ),
        _call("Write", {"file_path": str(work / "out" / "two.txt"), "content": "two\n"}),
        _call(
            "Bash", {"command": "cat out/one.txt out/two.txt && echo STEP$((1+2))_OK", "description": "show"}
        ),
        _call("Write", {"file_path": str(work / "out" / "three.txt"), "content": "three\n"}),
        "Done: the three files are written.",
    ]


@pytest.mark.slow
def test_claude_code_cli_through_proxy(tmp_path):
    if not CLAUDE.exists():
        pytest.fail(f"Claude Code CLI not installed at {CLAUDE}: run `npm ci` at the repo root")
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    tok = load_tiny_tokenizer(tok_dir)
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    replies = _script(work)
    rules = [
        # side calls (no tools): titles and the like
        ScriptRule(absent=["<tools>"], reply="Scripted session"),
        ScriptRule(last_contains=["three.txt (file state"], reply=replies[4]),
        ScriptRule(last_contains=["STEP3_OK"], reply=replies[3]),
        ScriptRule(last_contains=["two.txt (file state"], reply=replies[2]),
        ScriptRule(last_contains=["STEP1_OK"], reply=replies[1]),
        ScriptRule(contains=["<tools>"], reply=replies[0]),
    ]
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=rules, weight_version="v7"))
    url = eng.start()
    try:
        cfg = ProxyConfig(
            engines=[url],
            tokenizer=str(tok_dir),
            store=str(tmp_path / "store"),
            admin_token="adm",
            export_dirs=[
                str(tmp_path / "out")
            ],  # never a directory holding the store: an export could overwrite it
        )
        with ProxyServer(cfg) as srv:
            eid, cred = srv.register("cc-exec", group_id="g1")
            proc = _run_claude(
                srv.url, cred, home, work, "Run the scripted file task.", "Bash Write Edit Read"
            )
            assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
            result = json.loads(proc.stdout)
            assert result["is_error"] is False
            assert result["result"] == replies[4]

            # files the CLI wrote through its tools
            assert (work / "out" / "one.txt").read_text() == "one\n"
            assert (work / "out" / "two.txt").read_text() == "two\n"
            assert (work / "out" / "three.txt").read_text() == "three\n"

            ex = srv.proxy.executions[eid]
            tree = ex.records.tree
            records = list(tree.records())
            assert len(records) == len(eng.requests)  # every engine call is recorded, nothing else
            main = [r for r in records if r.role_class == "main/task"]
            assert len(main) == 5
            assert all(r.role_class == "other" for r in records if r not in main)
            im_end = tok.token_to_id("<|im_end|>")
            by_call = {r.call_id: i for i, r in enumerate(records)}
            for k, rec in enumerate(main):
                # exact tokens: the engine saw precisely parent path + incremental input, and produced the script
                sent = eng.requests[by_call[rec.call_id]]["input_ids"]
                assert list(tree.context_ids(rec.call_id)) == sent
                want = [*tok.encode(replies[k], add_special_tokens=False).ids, im_end]
                assert rec.output_ids == want
                assert rec.output_logprobs == [scripted_logprob(i, t) for i, t in enumerate(want)]
                assert [(s.engine_id, s.weight_version, s.start, s.end) for s in rec.output_segments] == [
                    (url, "v7", 0, len(want))
                ]
                assert rec.finish_reason == "stop"
                assert rec.metadata["volatile"] and rec.metadata["volatile"][0].startswith(
                    "x-anthropic-billing-header:"
                )
                # provenance: a call's incremental input is context (tool results, reminders), never policy output
                assert not any(mask_from_runs(rec.input_provenance))
                if k == 0:
                    assert rec.parent_id is None
                else:
                    # the chain matched despite the billing header
                    assert rec.parent_id == main[k - 1].call_id
                    inc = tok.decode(rec.input_ids, skip_special_tokens=False)
                    assert "<tool_response>" in inc
                    assert len(rec.input_ids) < 400  # only new content was encoded, not the 47k-token prompt
            assert "STEP1_OK" in tok.decode(main[1].input_ids)

            # the exported trajectory: one main/task path whose targets are exactly the five outputs
            r = srv.admin(
                "POST",
                f"/admin/executions/{eid}/export",
                {"j_max": 5, "seed": 1, "path": str(tmp_path / "out" / "t.jsonl")},
            )
            assert r.status_code == 200, r.text
            trajs = r.json()["trajectories"]
            assert len(trajs) == 1
            t = trajs[0]
            assert (
                t["role_class"] == "main/task"
                and t["leaf_call_id"] == main[-1].call_id
                and t["group_id"] == "g1"
            )
            assert t["token_ids"] == list(tree.path_tokens(main[-1].call_id))
            targets = [tid for tid, m in zip(t["token_ids"], t["target_mask"], strict=True) if m]
            assert targets == [tid for rec in main for tid in rec.output_ids]
            lps = [lp for lp, m in zip(t["behavior_logprobs"], t["target_mask"], strict=True) if m]
            assert lps == [lp for rec in main for lp in rec.output_logprobs]
            assert "<tool_response>" not in tok.decode(targets, skip_special_tokens=False)
            assert (tmp_path / "out" / "t.jsonl").read_text().count("\n") == 1

            # the ended execution's credential is refused in Anthropic's error shape
            assert srv.admin("POST", f"/admin/executions/{eid}/end").status_code == 200
            r = httpx.post(
                srv.url + "/v1/messages",
                headers={"x-api-key": cred},
                json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 401
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    finally:
        eng.stop()


@pytest.mark.slow
def test_claude_code_subagent_through_proxy(tmp_path):
    """The main agent delegates through the Agent tool: the sub-agent's calls form their own chain (`sub/task`)."""
    if not CLAUDE.exists():
        pytest.fail(f"Claude Code CLI not installed at {CLAUDE}: run `npm ci` at the repo root")
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    sub = "You are an agent for Claude Code"  # the sub-agent's system prompt
    delegate = _call(
        "Agent",
        {
            "description": "write sub file",
            "prompt": "Write the sub file.",
            "subagent_type": "general-purpose",
        },
    )
    rules = [
        ScriptRule(absent=["<tools>"], reply="Scripted session"),
        ScriptRule(
            contains=[sub],
            last_contains=["sub.txt (file state"],
            reply="Sub-agent finished: sub.txt written.",
        ),
        ScriptRule(
            contains=[sub],
            reply=_call("Write", {"file_path": str(work / "sub.txt"), "content": "from sub\n"}),
        ),
        ScriptRule(last_contains=["Sub-agent finished"], reply="All done."),
        ScriptRule(contains=["<tools>"], reply=delegate),
    ]
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=rules))
    url = eng.start()
    try:
        cfg = ProxyConfig(
            engines=[url], tokenizer=str(tok_dir), store=str(tmp_path / "store"), admin_token="adm"
        )
        with ProxyServer(cfg) as srv:
            eid, cred = srv.register("cc-sub")
            proc = _run_claude(
                srv.url, cred, home, work, "Delegate the file task.", "Bash Write Edit Read Agent"
            )
            assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
            assert json.loads(proc.stdout)["result"] == "All done."
            assert (work / "sub.txt").read_text() == "from sub\n"
            tree = srv.proxy.executions[eid].records.tree
            recs = list(tree.records())
            main = [r for r in recs if r.role_class == "main/task"]
            subs = [r for r in recs if r.role_class == "sub/task"]
            assert len(main) == 2 and len(subs) == 2
            assert main[0].parent_id is None and main[1].parent_id == main[0].call_id
            # the sub-agent chain matches its own prefix (Claude Code turns thinking off for it: the empty think
            # block of the generation prompt is restored in front of the recorded output)
            assert subs[0].parent_id is None and subs[1].parent_id == subs[0].call_id
            assert subs[0].agent_id == subs[1].agent_id != "main"
            assert "cc_is_subagent=" in subs[0].metadata["volatile"][0]
            r = srv.admin("POST", f"/admin/executions/{eid}/export", {"j_max": 5})
            trajs = r.json()["trajectories"]
            assert [t["role_class"] for t in trajs] == ["main/task", "sub/task"]
            assert sum(trajs[0]["target_mask"]) == sum(len(x.output_ids) for x in main)
            assert sum(trajs[1]["target_mask"]) == sum(len(x.output_ids) for x in subs)
    finally:
        eng.stop()
