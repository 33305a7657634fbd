"""The real Claude Code CLI through the proxy with a context growing past 100k tokens (engine limit 131072).

Claude Code asks for its full output cap (max_tokens 32000-64000) on every call. Before the clamp a session died once
prompt + max_tokens passed the engine's context (`prompt is too long: 73022 tokens + 64000 max tokens > 131072`);
now max_tokens is clamped to the room left (`context_overflow = "clamp"`, the default), the session completes, and each
record keeps what was asked and used. Verified with CLI 2.1.197: `"refuse"` (Anthropic's own 400, "input length and
`max_tokens` exceed context limit: A + B > C, ...") works too: the CLI lowers max_tokens and retries.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from gyre_tito.proxy import ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CLAUDE = ROOT / "node_modules" / ".bin" / "claude"
LIMIT = 131072


def _call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def _bash(k: int) -> str:
    # ~24k tokens of output per call (the tiny tokenizer spends about one token per digit); the marker is computed
    # by the shell so that it appears in the tool result only
    return _call("Bash", {"command": f"seq 1 5000 && echo BIG$(({k}+1))_OK", "description": f"print {k}"})


@pytest.mark.slow
@pytest.mark.parametrize("overflow", ["clamp", "refuse"])
def test_claude_code_session_past_100k_tokens(tmp_path, overflow):
    if not CLAUDE.exists():
        pytest.fail(f"Claude Code CLI not installed at {CLAUDE}: run `npm ci` at the repo root")
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    steps = 3
    rules = [ScriptRule(absent=["<tools>"], reply="Scripted session")]
    rules.append(ScriptRule(last_contains=[f"BIG{steps}_OK"], reply="Done: long context handled."))
    for k in range(steps - 1, 0, -1):
        rules.append(ScriptRule(last_contains=[f"BIG{k}_OK"], reply=_bash(k)))
    rules.append(ScriptRule(contains=["<tools>"], reply=_bash(0)))
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=rules, context_length=LIMIT))
    url = eng.start()
    try:
        cfg = ProxyConfig(
            engines=[url],
            tokenizer=str(tok_dir),
            store=str(tmp_path / "store"),
            admin_token="adm",
            max_context_tokens=LIMIT,
            context_overflow=overflow,
        )
        with ProxyServer(cfg) as srv:
            eid, cred = srv.register("cc-long")
            env = {
                "PATH": os.environ["PATH"],
                "HOME": str(home),
                "ANTHROPIC_BASE_URL": srv.url,
                "ANTHROPIC_API_KEY": cred,
                "DISABLE_TELEMETRY": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            }
            proc = subprocess.run(
                [
                    str(CLAUDE),
                    "-p",
                    "Print the numbers three times.",
                    "--allowedTools",
                    "Bash",
                    "--output-format",
                    "json",
                ],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
            result = json.loads(proc.stdout)
            assert result["is_error"] is False and result["result"] == "Done: long context handled."

            tree = srv.proxy.executions[eid].records.tree
            main = [r for r in tree.records() if r.role_class == "main/task"]
            assert len(main) == steps + 1
            contexts = [len(tree.context_ids(r.call_id)) for r in main]
            assert max(contexts) > 100_000, contexts
            last = main[-1].metadata["sampling"]
            asked = last["asked"]["max_tokens"]
            if overflow == "clamp":
                assert contexts[-1] + asked > LIMIT  # refused before the clamp
                assert last["used"]["max_tokens"] == LIMIT - contexts[-1]
            else:  # the CLI read Anthropic's error, lowered max_tokens and retried
                assert contexts[-1] + asked <= LIMIT and last["used"]["max_tokens"] == asked
                assert (
                    'gyre_tito_requests_total{api="anthropic",status="400"}'
                    in srv.admin("GET", "/metrics").text
                )
            sent = [len(b["input_ids"]) + b["sampling_params"]["max_new_tokens"] for b in eng.requests]
            assert max(sent) <= LIMIT
    finally:
        eng.stop()
