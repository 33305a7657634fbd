"""`load_request` returns exactly what `orjson.loads` does, parsing only the bytes a recent body did not have."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gyre_tito.request_bytes import RequestHistory, load_request

# Text that stresses the structural scan: quotes, escapes, brackets, non-ASCII, control characters.
_TEXT = st.text(alphabet=st.sampled_from(list('ab {}[]",:\\\n\t/é\u2028\x00')), max_size=12)
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": st.one_of(
            _TEXT,
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2),
        ),
    }
)


def _dump(body: dict, style: int) -> bytes:
    """The same body as different harnesses write it."""
    if style == 0:
        return orjson.dumps(body)
    if style == 1:
        return json.dumps(body).encode()  # ", " and ": ", \\u escapes
    return json.dumps(body, indent=1, ensure_ascii=False).encode()


def _same(raw: bytes, history: RequestHistory) -> dict:
    want = orjson.loads(raw)
    got = load_request(raw, history)
    assert got == want
    assert list(got) == list(want)  # key order too
    return got


# A step: append messages, rewrite the last one (a moved cache mark), swap to another conversation, change a field
# or the key order.
_STEP = st.tuples(
    st.sampled_from(["append", "append", "rewrite_last", "other", "field", "order"]),
    st.lists(_MESSAGE, min_size=1, max_size=3),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_MESSAGE, min_size=1, max_size=4), st.lists(_STEP, min_size=1, max_size=8), st.integers(0, 2))
@example(
    [{"role": "user", "content": "a"}],
    [("append", [{"role": "user", "content": '"]}'}]), ("rewrite_last", [{"role": "user", "content": ""}])],
    1,
)
def test_equals_a_whole_parse_on_any_sequence_of_bodies(first: list, steps: list, style: int) -> None:
    history = RequestHistory()
    convs = {0: list(first), 1: [{"role": "user", "content": "other agent"}]}
    current, model, first_keys = 0, "m", True
    for kind, msgs in steps:
        conv = convs[current]
        if kind == "append":
            conv.extend(msgs)
        elif kind == "rewrite_last":
            conv[-1] = msgs[0]
        elif kind == "other":
            current = 1 - current
            convs[current].extend(msgs)
        elif kind == "field":
            model += "x"
        else:
            first_keys = not first_keys
        fields = {"model": model, "max_tokens": 10}
        body = (
            {**fields, "messages": convs[current], "stream": True}
            if first_keys
            else {"system": [{"type": "text", "text": "s"}], "messages": convs[current], **fields}
        )
        _same(_dump(body, style), history)


def test_an_unchanged_prefix_keeps_its_message_objects() -> None:
    history = RequestHistory()
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    a = _same(orjson.dumps({"model": "m", "messages": msgs, "tools": []}), history)
    b = _same(
        orjson.dumps({"model": "m", "messages": [*msgs, {"role": "user", "content": "n"}], "tools": []}),
        history,
    )
    assert all(x is y for x, y in zip(a["messages"], b["messages"], strict=False))
    assert b["tools"] is a["tools"]  # the same bytes after the messages: the same values


def test_two_agents_taking_turns_both_stay_incremental() -> None:
    history = RequestHistory()
    main = [{"role": "user", "content": "main"}]
    sub = [{"role": "user", "content": "sub"}]
    seen = {}
    for turn in range(4):
        for name, conv in (("main", main), ("sub", sub)):
            conv.append({"role": "user", "content": f"{name}{turn}"})
            body = _same(orjson.dumps({"model": name, "messages": conv}), history)
            if name in seen:
                assert body["messages"][0] is seen[name]  # parsed once, reused on every later call
            seen[name] = body["messages"][0]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"a","messages":[{"role":"user","content":"x"}],"model":"b"}',  # a key twice
        b'{"messages":[{"role":"user","content":"x"}],"messages":[]}',
        b'{"messages":[{"role":"user","content":"x"},"text"],"m":1}',  # an element that is not an object
        b'{"messages":[{"role":"user","content":"x"}]}  ',
        b'{"\\u006dessages":[{"role":"user","content":"x"}],"a":1}',  # an escaped key
        b'{"messages":[]}',
        b"[1, 2]",
        b'"text"',
    ],
)
def test_unusual_bodies_parse_as_orjson_does(raw: bytes) -> None:
    history = RequestHistory()
    _same(raw, history)
    _same(raw, history)  # and again, against the state the first one left


@pytest.mark.parametrize(
    "tail",
    [
        b",]}",  # a trailing comma in the messages
        b',{"role":"user"},]}',
        b"],}",  # a trailing comma in the object
        b'] "x":1}',  # a missing comma
        b"]}}",  # trailing garbage
        b',{"role":"user"]}',  # brackets that do not close
    ],
)
def test_invalid_bodies_fail_as_orjson_does(tail: bytes) -> None:
    history = RequestHistory()
    base = b'{"model":"m","messages":[{"role":"user","content":"x"}'
    _same(base + b"]}", history)
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(base + tail)
    with pytest.raises(orjson.JSONDecodeError):
        load_request(base + tail, history)
