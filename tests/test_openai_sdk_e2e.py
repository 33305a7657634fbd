"""Acceptance 2 and 3: the official `openai` SDK runs a tool-calling agent loop through the proxy (streaming and not),
and a harness that reformats tool-call arguments (key order, whitespace) still matches its recorded prefix."""

import json
from typing import TYPE_CHECKING

import httpx
import pytest

from gyre_tito import openai_api
from gyre_tito.proxy import ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule, scripted_logprob
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer, load_tiny_tokenizer
from gyre_tito.types import mask_from_runs

if TYPE_CHECKING:  # the SDK takes a second or more to import: inside the tests, not at collection
    import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
FINAL = "It is sunny in Paris."


@pytest.fixture
def stack(tmp_path):
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    rules = [ScriptRule(last_contains=["<tool_response>"], reply=FINAL), ScriptRule(reply=CALL)]
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=rules))
    url = eng.start()
    cfg = ProxyConfig(engines=[url], tokenizer=str(tok_dir), store=str(tmp_path / "store"), admin_token="adm")
    srv = ProxyServer(cfg)
    srv.start()
    yield srv, eng, load_tiny_tokenizer(tok_dir)
    srv.stop()
    eng.stop()


def _weather(args: dict) -> str:
    return json.dumps({"city": args["city"], "sky": "sunny", "temp": 21})


def _agent_loop(client: "openai.OpenAI", stream: bool) -> tuple[list[dict], str]:
    messages: list[dict] = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    for _ in range(4):
        if stream:
            text, calls, finish = "", {}, None
            for chunk in client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=TOOLS,
                stream=True,
                logprobs=True,
                stream_options={"include_usage": True},
            ):
                if not chunk.choices:
                    continue
                d = chunk.choices[0].delta
                text += d.content or ""
                for tc in d.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    c["id"] = tc.id or c["id"]
                    if tc.function:
                        c["name"] += tc.function.name or ""
                        c["arguments"] += tc.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for _, c in sorted(calls.items())
            ]
        else:
            resp = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, logprobs=True
            )
            ch = resp.choices[0]
            assert ch.logprobs is not None and len(ch.logprobs.content) == resp.usage.completion_tokens
            text, finish = ch.message.content or "", ch.finish_reason
            tool_calls = [tc.model_dump() for tc in ch.message.tool_calls or []]
        if not tool_calls:
            assert finish == "stop"
            return messages, text
        assert finish == "tool_calls"
        messages.append({"role": "assistant", "content": text or None, "tool_calls": tool_calls})
        for tc in tool_calls:
            out = _weather(json.loads(tc["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": out})
    raise AssertionError("agent did not finish")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_agent_loop(stack, stream):
    import openai

    srv, eng, tok = stack
    eid, cred = srv.register()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=cred)
    messages, text = _agent_loop(client, stream)
    assert text == FINAL
    assert messages[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    tree = srv.proxy.executions[eid].records.tree
    recs = list(tree.records())
    assert len(recs) == 2
    first, second = recs
    assert second.parent_id == first.call_id  # the second call extends the first's recorded path
    want = [*tok.encode(FINAL, add_special_tokens=False).ids, tok.token_to_id("<|im_end|>")]
    assert second.output_ids == want
    assert second.output_logprobs == [scripted_logprob(i, t) for i, t in enumerate(want)]
    inc = tok.decode(second.input_ids, skip_special_tokens=False)
    assert inc.startswith("\n<|im_start|>user\n<tool_response>\n") and '"sky": "sunny"' in inc
    assert not any(mask_from_runs(second.input_provenance))
    assert list(tree.context_ids(second.call_id)) == eng.requests[-1]["input_ids"]


def _anthropic_turn(url: str, cred: str, messages: list, tools: list) -> dict:
    r = httpx.post(
        url + "/v1/messages",
        headers={"x-api-key": cred, "anthropic-version": "2023-06-01"},
        json={
            "model": "m",
            "max_tokens": 200,
            "messages": messages,
            "tools": tools,
            "some_future_field": {"x": 1},
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_reformatted_tool_arguments_still_match_prefix(stack):
    """Acceptance 3: the harness re-serialises the tool call (key order, whitespace) before sending it back."""
    import openai

    srv, _, _ = stack
    # Anthropic shape: input dict with keys reordered
    eid, cred = srv.register()
    tools = [
        {"name": "get_weather", "description": "Weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    ]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    a = _anthropic_turn(srv.url, cred, msgs, tools)
    use = a["content"][0]
    assert use["type"] == "tool_use" and use["input"] == {"city": "Paris", "unit": "celsius"}
    reordered = {
        "type": "tool_use",
        "name": use["name"],
        "input": {"unit": "celsius", "city": "Paris"},
        "id": use["id"],
    }
    msgs += [
        {"role": "assistant", "content": [reordered]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}]},
    ]
    b = _anthropic_turn(srv.url, cred, msgs, tools)
    assert b["content"][0]["text"] == FINAL
    recs = list(srv.proxy.executions[eid].records.tree.records())
    assert recs[1].parent_id == recs[0].call_id
    # OpenAI shape: arguments string with other whitespace and key order
    eid2, cred2 = srv.register()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=cred2)
    m = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="p", messages=m, tools=TOOLS)
    tc = r.choices[0].message.tool_calls[0]
    ugly = json.dumps({"unit": "celsius", "city": "Paris"}, indent=4)
    m += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": tc.id, "type": "function", "function": {"name": "get_weather", "arguments": ugly}}
            ],
        },
        {"role": "tool", "tool_call_id": tc.id, "content": "sunny"},
    ]
    r2 = client.chat.completions.create(model="p", messages=m, tools=TOOLS)
    assert r2.choices[0].message.content == FINAL
    recs2 = list(srv.proxy.executions[eid2].records.tree.records())
    assert recs2[1].parent_id == recs2[0].call_id
    # without the payload cache the reformatted call renders differently and would not match the recorded path
    conv, *_ = openai_api.parse_request({"model": "p", "messages": m, "tools": TOOLS}, [])
    chat = srv.proxy.chat
    naive = chat.encode_text(chat.render(conv.template_messages(lambda t: None), conv.tools)).tolist()
    tree2 = srv.proxy.executions[eid2].records.tree
    path0 = list(tree2.path_tokens(recs2[0].call_id))
    assert naive[: len(path0)] != path0
    assert list(tree2.context_ids(recs2[1].call_id))[: len(path0)] == path0


def test_openai_errors_have_openai_shape(stack):
    import openai

    srv, _, _ = stack
    _, cred = srv.register()
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope")
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    assert ei.value.status_code == 401
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {cred}"},
        json={"model": "p", "messages": [{"role": "tool", "tool_call_id": "call_x", "content": "r"}]},
    )
    assert r.status_code == 400 and "unknown tool call id" in r.json()["error"]["message"]
    r = httpx.post(
        srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {cred}"}, content=b"[1,"
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n=1"):
        openai.OpenAI(base_url=srv.url + "/v1", api_key=cred).chat.completions.create(
            model="p", messages=[{"role": "user", "content": "x"}], n=2
        )
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {cred}"},
        json={"model": "p", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
    )
    assert r.status_code == 400
