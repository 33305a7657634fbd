"""Incremental encoding gives exactly the ids and policy flags of rendering and encoding the whole request, on
randomised agent conversations (tool calls, grouped tool results, new user queries that move the last query, harness
turns with reasoning, text-only replies, histories that are cut back or edited, a changed system prompt, thinking
turned off), and it really reuses what the last request encoded."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from gyre_tito import anthropic_api, incremental, openai_api
from gyre_tito.conversation import DEFAULT_VOLATILE_PATTERNS, common_prefix
from gyre_tito.proxy import Proxy, ProxyConfig
from gyre_tito.request_bytes import load_request
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

TOOLS = [
    {"name": "Bash", "description": "run ü", "input_schema": {"type": "object"}},
    {"name": "Read", "description": "read", "input_schema": {"type": "object"}},
]


def _call(name: str, arg: str) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": {"x": "' + arg + '"}}\n</tool_call>'


def _replies(rng: random.Random):
    def reply(_prompt: str, _last: str) -> str:
        kind = rng.randrange(4)
        if kind == 0:
            return _call("Bash", f"ls {rng.randrange(99)}")
        if kind == 1:
            return _call("Bash", "a") + "\n" + _call("Read", f"f{rng.randrange(9)}")
        if kind == 2:
            return f"<think>\nplan {rng.randrange(99)}\n</think>\n\nLet me look.\n" + _call("Read", "g")
        return f"All done {rng.randrange(999)}."

    return reply


@pytest.fixture
def setup(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    rng = random.Random(0)
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok)), reply_fn=_replies(rng))
    url = eng.start()
    proxy = Proxy(ProxyConfig(engines=[url], tokenizer=str(tok), store=str(tmp_path / "s"), fsync=False))
    assert proxy.chat.native
    yield proxy, rng
    asyncio.run(proxy.aclose())
    eng.stop()


def _whole(proxy: Proxy, ex, conv):
    proxy.config.incremental_encode = False
    try:
        return proxy.encode(ex, conv)
    finally:
        proxy.config.incremental_encode = True


def _user_turn(rng: random.Random, uses: list[dict]) -> dict:
    if uses and rng.random() < 0.8:
        blocks = [
            {
                "type": "tool_result",
                "tool_use_id": u["id"],
                "content": f"out {rng.randrange(10**6)} " * rng.randrange(1, 30),
            }
            for u in uses
        ]
        if rng.random() < 0.2:
            blocks.append({"type": "text", "text": "also this"})
        return {"role": "user", "content": blocks}
    return {"role": "user", "content": f"new question {rng.randrange(999)}"}


@pytest.mark.parametrize("seed", range(6))
def test_incremental_encoding_equals_whole_encoding(setup, seed):
    proxy, _ = setup
    rng = random.Random(seed)
    ex, _ = proxy.register(f"ex{seed}")
    system = "You are a helpful agent."
    history: list[dict] = [{"role": "user", "content": "Fix the tests."}]
    thinking = None
    loop = asyncio.new_event_loop()
    reused = 0
    for _step in range(40):
        body = {"model": "m", "max_tokens": 64, "system": system, "tools": TOOLS, "messages": history}
        if thinking is not None:
            body["thinking"] = thinking
        conv, sampling, _ = anthropic_api.parse_request(
            load_request(orjson.dumps(body), ex.request_history), DEFAULT_VOLATILE_PATTERNS, ex.turn_cache
        )
        before = ex.encode_state
        ids, policy = proxy.encode(ex, conv)
        whole_ids, whole_policy = _whole(proxy, ex, conv)
        assert ids.tolist() == whole_ids.tolist()
        assert policy == whole_policy
        if (
            before.key is not None
            and before.ids
            and ids[: len(before.ids) // 2] == before.ids[: len(before.ids) // 2]
        ):
            reused += 1
        # what the harness does next
        r = rng.random()
        if r < 0.08 and len(history) > 3:  # cut the history back (a retry, a rewind): a branch
            history = history[: rng.randrange(1, len(history) - 1)]
            while history[-1]["role"] == "assistant":
                history.pop()
            continue
        if r < 0.12 and len(history) > 2:  # an edited early message
            history = [{"role": "user", "content": "Fix the tests, carefully."}, *history[1:]]
            continue
        if r < 0.15:
            system = system + " Be brief."
            continue
        if r < 0.18:
            thinking = {"type": "disabled"} if thinking is None else None
            continue
        # a harness-written assistant turn with reasoning (not one of ours), maybe calling a tool
        if r < 0.25:
            hid = f"toolu_h{len(history)}"
            own = (
                [{"type": "tool_use", "id": hid, "name": "Bash", "input": {"x": "h"}}]
                if rng.random() < 0.6
                else []
            )
            thought = [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "text", "text": f"note {rng.randrange(99)}"},
            ]
            history += [{"role": "assistant", "content": thought + own}, _user_turn(rng, own)]
            continue
        if r < 0.3 and history[-1]["role"] == "user" and isinstance(history[-1]["content"], list):
            # more results for the same calls in a message of their own (its part joins the previous one)
            ids = [b["tool_use_id"] for b in history[-1]["content"] if b["type"] == "tool_result"]
            if ids:
                history.append(
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": ids[0], "content": "more"}],
                    }
                )
                continue
        reply, _rec = loop.run_until_complete(proxy.complete(ex, conv, sampling, "anthropic", {}, body))
        blocks = [{"type": "text", "text": reply.text}] if reply.text else []
        uses = [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in reply.tool_calls
        ]
        if blocks and uses and rng.random() < 0.5:  # some harnesses split one response into several messages
            history += [{"role": "assistant", "content": blocks}, {"role": "assistant", "content": uses}]
        else:
            history.append({"role": "assistant", "content": blocks + uses or [{"type": "text", "text": ""}]})
        history.append(_user_turn(rng, uses))
    loop.run_until_complete(proxy.pool.aclose())  # its pooled engine connections belong to this loop
    loop.close()
    assert reused >= 10  # the common case did reuse the last request's ids


def test_a_grown_request_encodes_only_its_new_messages(setup, monkeypatch):
    """The second request renders and encodes only what follows the first one's unchanged messages."""
    proxy, _ = setup
    ex, _ = proxy.register("grow")
    history = [{"role": "user", "content": "q " * 50}]
    for k in range(30):
        history += [{"role": "assistant", "content": f"a{k}"}, {"role": "user", "content": f"u{k} " * 20}]
    body = {"model": "m", "max_tokens": 8, "tools": TOOLS, "messages": history}
    conv, _, _ = anthropic_api.parse_request(body, DEFAULT_VOLATILE_PATTERNS, ex.turn_cache)
    proxy.encode(ex, conv)
    rendered: list[int] = []
    real_chunk = incremental.qwen3_chunk
    monkeypatch.setattr(
        incremental, "qwen3_chunk", lambda m, j, lq: rendered.append(j) or real_chunk(m, j, lq)
    )
    grown = {
        **body,
        "messages": [*history, {"role": "assistant", "content": "b"}, {"role": "user", "content": "v"}],
    }
    conv2, _, _ = anthropic_api.parse_request(grown, DEFAULT_VOLATILE_PATTERNS, ex.turn_cache)
    assert conv2.turns[:61] == conv.turns and all(
        a is b for a, b in zip(conv.turns, conv2.turns, strict=False)
    )
    ids, _ = proxy.encode(ex, conv2)
    assert rendered == [60, 61, 62]  # the old last message (its part can change) and the two new ones
    assert ids.tolist() == _whole(proxy, ex, conv2)[0].tolist()


def test_an_openai_body_keeps_the_turns_of_the_messages_it_repeats(setup):
    """Chat-completions bodies: messages repeated byte for byte keep their turns, and the encoding stays exact."""
    proxy, _ = setup
    ex, _ = proxy.register("chat")
    history: list[dict] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q " * 30}]
    last = None
    for k in range(4):
        raw = orjson.dumps({"model": "m", "messages": history})
        conv, _, _, _ = openai_api.parse_request(
            load_request(raw, ex.request_history), DEFAULT_VOLATILE_PATTERNS, ex.turn_cache
        )
        assert conv.system == "be brief" and len(conv.turns) == len(history) - 1
        if last is not None:  # the turns of every message the last body had: the same objects
            assert all(a is b for a, b in zip(last.turns, conv.turns[: len(last.turns)], strict=True))
        ids, _ = proxy.encode(ex, conv)
        assert ids.tolist() == _whole(proxy, ex, conv)[0].tolist()
        history += [{"role": "assistant", "content": f"a{k}"}, {"role": "user", "content": f"u{k} " * 9}]
        last = conv


def test_common_prefix():
    a = [1, 2, 3, 4, 5]
    assert [common_prefix(a, b) for b in ([], [1, 2], a, [1, 2, 9, 4, 5], [9], [1, 2, 3, 4, 5, 6])] == [
        0,
        2,
        5,
        2,
        0,
        5,
    ]
