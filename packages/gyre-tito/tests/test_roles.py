"""Role classifiers: the Claude Code default on requests shaped like Claude Code's, and the static plug-in."""

from __future__ import annotations

import pytest

from gyre_tito.roles import (
    ClaudeCodeClassifier,
    ClaudeCodeSignals,
    RoleClassifier,
    RoleInfo,
    StaticClassifier,
    make_classifier,
)

MAIN_BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=sdk-cli; cch=00000;"
SUB_BILLING = (
    "x-anthropic-billing-header: cc_version=2.1.197.c2d; cc_entrypoint=sdk-cli; cc_is_subagent=true; cch=0;"
)
MAIN_SYSTEM = (
    "You are an interactive agent that helps users with software engineering tasks. Use the tools..."
)
SUB_SYSTEM = (
    "You are an agent for Claude Code, Anthropic's official CLI for Claude. Given the user's message..."
)
COMPACT = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n- Do NOT use Read, Bash, ...\n"
    "Your task is to create a detailed summary of the conversation so far, paying close attention to ..."
)
TOOLS = [
    {"name": n, "description": n, "input_schema": {"type": "object"}}
    for n in ("Agent", "Bash", "Edit", "Read")
]


def request(billing: str, system: str, messages: list, tools=TOOLS) -> dict:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": billing},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "tools": tools,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []},
        "metadata": {"user_id": "u"},
    }


def user(*texts: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": t} for t in texts]}


HISTORY = [
    {"role": "system", "content": "Available agent types for the Agent tool: general-purpose, Explore"},
    user("<system-reminder>\nAs you answer the user's questions...\n</system-reminder>", "Write hello.py"),
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]},
]


@pytest.fixture
def cc() -> ClaudeCodeClassifier:
    return ClaudeCodeClassifier()


def test_main_agent_task_call(cc):
    assert cc.classify(request(MAIN_BILLING, MAIN_SYSTEM, HISTORY)) == RoleInfo("main", "main/task", "task")


def test_main_agent_compaction_is_main_summary(cc):
    msgs = [*HISTORY, user(COMPACT)]
    assert cc.classify(request(MAIN_BILLING, MAIN_SYSTEM, msgs)) == ("main", "main/summary", "summary")


def test_subagent_task_and_summary(cc):
    sub = [user("Find every TODO in src/ and report them.")]
    info = cc.classify(request(SUB_BILLING, SUB_SYSTEM, sub))
    assert info.role_class == "sub/task" and info.call_kind == "task" and info.agent_id.startswith("sub-")
    # Same sub-agent later in its conversation: same agent id.
    later = [*sub, {"role": "assistant", "content": "looking"}, user("tool output")]
    assert cc.classify(request(SUB_BILLING, SUB_SYSTEM, later)).agent_id == info.agent_id
    other = cc.classify(request(SUB_BILLING, SUB_SYSTEM, [user("A different delegated task")]))
    assert other.agent_id != info.agent_id
    summary = cc.classify(request(SUB_BILLING, SUB_SYSTEM, [*later, user(COMPACT)]))
    assert summary == (info.agent_id, "sub/summary", "summary")


def test_subagent_detected_by_billing_flag_or_system_text_alone(cc):
    explore = "You are a file search specialist for Claude Code, Anthropic's official CLI for Claude."
    assert cc.classify(request(SUB_BILLING, explore, [user("find x")])).role_class == "sub/task"
    assert cc.classify(request(MAIN_BILLING, SUB_SYSTEM, [user("find x")])).role_class == "sub/task"
    off = MAIN_BILLING.replace("cch", "cc_is_subagent=false; cch")
    assert cc.classify(request(off, MAIN_SYSTEM, [user("x")])).role_class == "main/task"


def test_side_calls_without_tools_are_other(cc):
    title = request(
        MAIN_BILLING,
        "Generate a concise, sentence-case title (3-7 words) for this session.",
        [user("Write hello.py")],
        tools=None,
    )
    del title["tools"]
    assert cc.classify(title) == RoleInfo("side", "other", "side")
    assert cc.classify(request(MAIN_BILLING, MAIN_SYSTEM, [user("hi")], tools=[])).role_class == "other"


def test_compaction_needs_the_marker_at_the_start_and_a_summary_request(cc):
    quoted = [*HISTORY, user("Please explain: " + COMPACT)]
    assert cc.classify(request(MAIN_BILLING, MAIN_SYSTEM, quoted)).role_class == "main/task"
    no_summary = [*HISTORY, user("CRITICAL: Respond with TEXT ONLY. Do NOT call any tools. List files.")]
    assert cc.classify(request(MAIN_BILLING, MAIN_SYSTEM, no_summary)).role_class == "main/task"
    # Only the last user message counts: an old compaction prompt earlier in history is not this call's purpose.
    old = [user(COMPACT), {"role": "assistant", "content": "summary"}, user("continue")]
    assert cc.classify(request(MAIN_BILLING, MAIN_SYSTEM, old)).role_class == "main/task"
    # String content and string system prompts work too.
    plain = {"system": MAIN_SYSTEM, "tools": TOOLS, "messages": [{"role": "user", "content": COMPACT}]}
    assert cc.classify(plain).role_class == "main/summary"


def test_malformed_requests_do_not_crash(cc):
    assert cc.classify({}) == ("side", "other", "side")
    assert cc.classify({"tools": TOOLS, "messages": "nope", "system": 5}).role_class == "main/task"
    assert cc.classify(
        {"tools": TOOLS, "messages": [None, {"role": "user", "content": [3, None]}]}
    ).role_class == ("main/task")


def test_signals_are_configurable():
    cc = ClaudeCodeClassifier(
        signals=ClaudeCodeSignals(compaction_prefix="SUMMARIZE NOW", compaction_keyword="")
    )
    msgs = [user("SUMMARIZE NOW please")]
    assert cc.classify(request(MAIN_BILLING, MAIN_SYSTEM, msgs)).role_class == "main/summary"


def test_static_classifier_and_registry():
    assert StaticClassifier().classify({"messages": []}) == ("main", "main/task", "task")
    assert StaticClassifier(role_class="sub/task", agent_id="a").classify({}) == ("a", "sub/task", "task")
    with pytest.raises(ValueError, match="unknown role class"):
        StaticClassifier(role_class="boss/task")  # type: ignore[arg-type]
    assert isinstance(make_classifier("claude-code"), ClaudeCodeClassifier)
    assert isinstance(make_classifier("static"), RoleClassifier)
    with pytest.raises(ValueError, match="choose one of"):
        make_classifier("cursor")


def test_agent_id_header_names_the_subagent_and_is_case_insensitive(cc):
    body = request(MAIN_BILLING, "You are a file search specialist.", [user("find x")])
    info = cc.classify(body, {"X-Claude-Code-Agent-Id": "a5de921c9073e3b57"})
    assert info == RoleInfo("sub-a5de921c9073e3b57", "sub/task", "task")
    assert cc.classify(body, {"x-claude-code-agent-id": "a5de921c9073e3b57"}) == info
    assert cc.classify(body, {"x-claude-code-agent-id": ""}).role_class == "main/task"


def test_requests_captured_from_the_real_cli():
    """Requests Claude Code 2.1.197 really sent (two sub-agents, a forced compaction), classified as they are."""
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).parent / "data" / "claude_code_2.1.197_requests.json").read_text())
    cc = ClaudeCodeClassifier()
    got = [cc.classify(r["body"], r["headers"]) for r in doc["requests"]]
    assert [g.role_class for g in got] == [r["expected_role_class"] for r in doc["requests"]]
    subs = [g.agent_id for g in got if g.role_class.startswith("sub/")]
    assert subs == ["sub-a5de921c9073e3b57", "sub-a22c1ffa6ec15b6c8"]
    # The main agent's tool result names the sub-agent by the same id the header carries.
    assert "a5de921c9073e3b57" in json.dumps(doc["requests"][2]["body"]["messages"][-1])
    # Without headers the body alone still gives the right classes (billing line flag, system text).
    assert [cc.classify(r["body"]).role_class for r in doc["requests"]] == [g.role_class for g in got]
    assert all(g.agent_id == "main" for g in got if g.role_class.startswith("main/"))
