import orjson
import pytest

from gyre_tito import anthropic_api
from gyre_tito.conversation import DEFAULT_VOLATILE_PATTERNS, Reply, ToolCall
from gyre_tito.errors import ProtocolError

VP = DEFAULT_VOLATILE_PATTERNS


def _events(frames):
    out = []
    for f in frames:
        head, data = f.decode().split("\n", 1)
        assert f.endswith(b"\n\n") and head.startswith("event: ") and data.startswith("data: ")
        obj = orjson.loads(data[6:])
        assert obj["type"] == head[7:]
        out.append(obj)
    return out


def test_parse_claude_code_shaped_request():
    body = {
        "model": "claude-x",
        "max_tokens": 100,
        "stream": True,
        "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 10},
        "context_management": {},
        "output_config": {},
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=sdk-cli;",
            },
            {"type": "text", "text": "You are an interactive agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            {"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search"},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>r</system-reminder>"},
                    {"type": "text", "text": "do it"},
                ],
            },
            {"role": "system", "content": "Available agent types: ..."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "a.txt"}],
                    },
                    {"type": "text", "text": "next"},
                ],
            },
        ],
    }
    conv, sampling, stream = anthropic_api.parse_request(body, VP)
    assert stream and sampling.max_new_tokens == 100
    assert conv.system == "You are an interactive agent."
    assert conv.volatile == ["x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=sdk-cli;"]
    assert [t.role for t in conv.turns] == ["user", "system", "assistant", "tool", "user"]
    assert conv.turns[2].reasoning == "hm" and conv.turns[2].tool_calls[0].arguments == {"command": "ls"}
    assert conv.turns[3].content == "a.txt" and conv.turns[3].tool_call_id == "toolu_1"
    assert [t["function"]["name"] for t in conv.tools] == ["Bash"]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "max_tokens": "a", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 1, "messages": []}, "messages"),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "bot", "content": "x"}]}, "role"),
        (
            {
                "model": "m",
                "max_tokens": 1,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_zz", "content": "r"}],
                    }
                ],
            },
            "unknown tool call id",
        ),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": 5}]}, "content"),
        ([1, 2], "object"),
    ],
)
def test_bad_requests_raise_400(body, needle):
    with pytest.raises(ProtocolError) as ei:
        anthropic_api.parse_request(body, VP)
    assert ei.value.status == 400 and ei.value.kind == "invalid_request_error" and needle in ei.value.message


def test_sse_event_sequence_is_exact():
    r = Reply(
        id="msg_1",
        model="m",
        reasoning="think",
        text="hi there",
        tool_calls=[ToolCall("toolu_a", "Bash", {"command": "ls"})],
        finish="stop",
        stop_sequence=None,
        input_tokens=10,
        output_tokens=7,
    )
    ev = _events(anthropic_api.sse_events(r))
    assert [e["type"] for e in ev] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert ev[0]["message"]["content"] == [] and ev[0]["message"]["usage"]["input_tokens"] == 10
    assert ev[2]["delta"] == {"type": "thinking_delta", "thinking": "think"}
    assert ev[3]["delta"]["type"] == "signature_delta"
    assert ev[6]["delta"] == {"type": "text_delta", "text": "hi there"}
    assert ev[8]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {}}
    assert orjson.loads(ev[9]["delta"]["partial_json"]) == {"command": "ls"}
    assert ev[11]["delta"]["stop_reason"] == "tool_use" and ev[11]["usage"]["output_tokens"] == 7
    body = anthropic_api.response_body(r)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"] and body[
        "stop_reason"
    ] == "tool_use"
    r2 = Reply(
        id="m",
        model="m",
        reasoning=None,
        text="x",
        tool_calls=[],
        finish="length",
        stop_sequence=None,
        input_tokens=1,
        output_tokens=1,
    )
    assert anthropic_api.response_body(r2)["stop_reason"] == "max_tokens"
