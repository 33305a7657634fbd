"""Harness adapters behind one interface: each one, launched by the execution runner against the TITO proxy on the
scripted engine, works in its own workspace, talks to the proxy with the execution's own key only (every call is
recorded under that execution), and sees none of the host's environment beyond the allow-list."""

import asyncio
import json
import sys
from pathlib import Path

import pytest

from gyre_sched.harness import (
    BuiltinHarness,
    ClaudeCodeHarness,
    CommandHarness,
    Harness,
    HarnessContext,
    make_harness,
)
from gyre_sched.runner import ExecutionRunner
from gyre_sched.sandbox import LaunchSandbox
from gyre_tito.proxy import ProxyConfig
from gyre_tito.records import log_path, read_log
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CLAUDE = ROOT / "node_modules" / ".bin" / "claude"
SECRET = "host-secret-must-not-leak"

# A command harness: one Anthropic call with the key it was given, its reply and its whole environment to files.
CLIENT = r"""
import json, os, sys, httpx
r = httpx.post(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages", timeout=60,
               headers={"x-api-key": os.environ["ANTHROPIC_API_KEY"]},
               json={"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": sys.argv[1]}]})
r.raise_for_status()
open("answer.txt", "w").write(r.json()["content"][0]["text"])
json.dump(dict(os.environ), open("env.json", "w"))
"""


def _call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture
def stack(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_HOST_SECRET", SECRET)  # in the runner's environment: no harness may see it
    tok = build_tiny_tokenizer(tmp_path / "tok")
    rules = [
        ScriptRule(contains=["ENVDUMP"], last_contains=["ENV1DONE"], reply="Env written."),
        ScriptRule(
            contains=["ENVDUMP", "<tools>"],
            reply=_call(
                "Bash",
                {"command": "env > env.txt && pwd >> env.txt && echo ENV$((2-1))DONE", "description": "env"},
            ),
        ),
        ScriptRule(absent=["<tools>"], contains=["ENVDUMP"], reply="Scripted session"),
        ScriptRule(reply="the answer is red"),
    ]
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), rules=rules))
    eng.start()
    cfg = ProxyConfig(
        engines=[eng.url], tokenizer=str(tok), store=str(tmp_path / "store"), admin_token="adm-secret"
    )
    with ProxyServer(cfg) as srv:
        yield srv, eng, tmp_path / "run"
    eng.stop()


async def _run(srv, run_dir, default, eid, task, sandbox=None, **kw):
    runner = ExecutionRunner(run_dir, srv.url, "adm-secret", default, 120.0, sandbox=sandbox)
    try:
        return await runner.run(eid, "g", srv.proxy.config.engines[0], task, **kw)
    finally:
        await runner.aclose()


def _records(srv, eid):
    return read_log(log_path(Path(srv.proxy.config.store) / "records", eid)).records


def _check_contract(srv, done, eid, env: dict[str, str]):
    assert done.outcome == "completed" and done.returncode == 0
    info = srv.admin("GET", f"/admin/executions/{eid}").json()
    assert info["ended"] and info["calls"] >= 1 and len(_records(srv, eid)) == info["calls"]
    assert all(r.execution_id == eid for r in _records(srv, eid))
    assert SECRET not in json.dumps(env) and "adm-secret" not in json.dumps(env)
    assert not any(k.startswith("GYRE_TITO") or k == "GYRE_HOST_SECRET" for k in env)


def test_every_adapter_satisfies_the_interface(tmp_path):
    ctx = HarnessContext("e1", tmp_path / "ws", "do {workspace} it", "http://127.0.0.1:1", "tito-key", "pol")
    (tmp_path / "ws").mkdir()
    for spec in ("builtin", "openai-agent", "command", "claude-code"):
        h = make_harness(spec if spec != "command" else {"kind": "command", "command": ["echo", "{task}"]})
        assert isinstance(h, Harness)
        argv, env = h.argv(ctx), h.env(ctx)
        assert all(isinstance(a, str) for a in argv) and "do {workspace} it" in argv  # the task, verbatim
        keys = {k for k, v in env.items() if v == "tito-key"}
        assert keys and keys <= {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"}
        assert all(v.startswith("http://127.0.0.1:1") for k, v in env.items() if k.endswith("BASE_URL"))
    cc = ClaudeCodeHarness(
        binary="claude", allowed_tools=("Bash", "Write"), max_turns=7, max_output_tokens=4096
    )
    argv, env = cc.argv(ctx), cc.env(ctx)
    assert argv[:3] == ["claude", "-p", "do {workspace} it"]
    assert (
        argv[argv.index("--allowedTools") + 1] == "Bash Write" and argv[argv.index("--max-turns") + 1] == "7"
    )
    assert argv[argv.index("--model") + 1] == "pol" and env["ANTHROPIC_MODEL"] == "pol"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096" and env["HOME"] == str(tmp_path / "ws.home")
    assert BuiltinHarness(max_turns=3).argv(ctx)[1:3] == ["-m", "gyre.demo.agent"]
    for bad in (
        "emacs",
        {"kind": "command"},
        {"kind": "claude-code", "max_turns": 0},
        {"kind": "builtin", "x": 1},
    ):
        with pytest.raises(ValueError):
            make_harness(bad)


def test_command_harness_contract(stack):
    srv, _, run_dir = stack
    h = CommandHarness([sys.executable, "-c", CLIENT, "{task}"])
    done = asyncio.run(_run(srv, run_dir, h, "cmd-1", "what colour?"))
    env = json.loads((done.workspace / "env.json").read_text())
    _check_contract(srv, done, "cmd-1", env)
    assert (done.workspace / "answer.txt").read_text() == "the answer is red"
    assert env["ANTHROPIC_API_KEY"] == env["OPENAI_API_KEY"] and env["ANTHROPIC_API_KEY"].startswith("tito-")
    assert env["OPENAI_BASE_URL"] == srv.url + "/v1"


def test_builtin_harness_contract_and_per_execution_choice(stack):
    srv, _, run_dir = stack
    # the run's harness is `command`; this execution chooses the built-in agent
    done = asyncio.run(
        _run(
            srv,
            run_dir,
            ["false"],
            "builtin-1",
            "Say the colour.",
            harness={"kind": "builtin", "max_turns": 2},
        )
    )
    ctx = HarnessContext("builtin-1", done.workspace, "t", srv.url, "tito-x")
    runner = ExecutionRunner(run_dir, srv.url, "adm-secret", BuiltinHarness(), 10.0)
    env = runner._env(BuiltinHarness(), ctx)
    asyncio.run(runner.aclose())
    _check_contract(srv, done, "builtin-1", env)
    assert (done.workspace / "answer.txt").read_text().strip() == "the answer is red"
    assert srv.admin("GET", "/admin/executions/builtin-1").json()["calls"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("sandboxed", [False, True], ids=["plain", "sandboxed"])
def test_claude_code_harness_contract(stack, sandboxed):
    if not CLAUDE.exists():
        pytest.fail(f"Claude Code CLI not installed at {CLAUDE}: run `npm ci` at the repo root")
    srv, _, run_dir = stack
    h = ClaudeCodeHarness(binary=str(CLAUDE), allowed_tools=("Bash",), max_turns=5, max_output_tokens=2048)
    sandbox = LaunchSandbox() if sandboxed else None  # bubblewrap: own namespaces, network only to the proxy
    done = asyncio.run(_run(srv, run_dir, h, "cc-1", "ENVDUMP: write your environment to env.txt.", sandbox))
    log = (run_dir / "logs" / "agents" / "cc-1.log").read_text()
    assert json.loads(log)["result"] == "Env written.", log[-2000:]
    lines = (done.workspace / "env.txt").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    _check_contract(srv, done, "cc-1", env)
    assert lines[-1] == str(done.workspace)  # it worked in its own workspace
    assert env["ANTHROPIC_API_KEY"].startswith("tito-") and env["HOME"] == str(done.workspace) + ".home"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "2048"
    recs = _records(srv, "cc-1")
    main = [r for r in recs if r.role_class == "main/task"]
    assert len(main) == 2 and all(r.metadata["sampling"]["asked"]["max_tokens"] <= 2048 for r in main)
