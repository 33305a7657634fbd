import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_tito.errors import TemplateError
from gyre_tito.render import ChatTokenizer, recorded_marker
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatTokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def test_piecewise_encoding_equals_whole_encoding(chat):
    msgs = [
        {"role": "system", "content": "sys prompt"},
        {"role": "user", "content": "héllo <tool_call> inside text? 🎉"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "Bash", "arguments": {"command": "ls -la"}}}],
        },
        {"role": "tool", "content": "a.txt\nb.txt"},
    ]
    text = chat.render(msgs, [{"type": "function", "function": {"name": "Bash", "parameters": {}}}])
    whole = chat.tokenizer.encode(text, add_special_tokens=False).ids
    assert chat.encode_text(text).tolist() == whole
    assert chat.encode_text(text).tolist() == whole  # second time from the piece cache
    assert chat.decode(whole) == text


def test_recorded_outputs_are_spliced_verbatim(chat):
    # a non-canonical tokenization of the same text, as a sampler may produce: one id per byte-level piece
    out_text = "<think>\nplan\n</think>\n\nhello"
    canon = chat.encode_text(out_text).tolist()
    weird = [
        t
        for ch in ["<think>", "\n", "p", "l", "a", "n", "\n", "</think>", "\n", "\n", "h", "e", "l", "l", "o"]
        for t in chat.encode_text(ch)
    ] + [chat.im_end_id]
    assert weird[:-1] != canon and chat.decode(weird[:-1]) == out_text
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": recorded_marker(0)},
        {"role": "user", "content": "more"},
    ]
    text = chat.render(msgs)
    enc = chat.encode_rendered(text, [weird])
    start = enc.policy.index(1)
    assert enc.ids[start : start + len(weird)].tolist() == weird
    assert sum(enc.policy) == len(weird)
    # the template's own <|im_end|> after the turn is not added twice
    assert enc.ids[start + len(weird)] != chat.im_end_id
    assert chat.decode(enc.ids.tolist()).count("<|im_end|>") == 3
    # Qwen3 re-rendering would have dropped the reasoning of this earlier turn: splicing keeps the recorded tokens
    plain = chat.render([msgs[0], {"role": "assistant", "content": out_text}, msgs[2]])
    assert "plan" not in plain


def test_unknown_marker_and_template_errors_are_template_errors(chat):
    with pytest.raises(TemplateError):
        chat.encode_rendered(recorded_marker(3), [])
    with pytest.raises(TemplateError):
        chat.render([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": object()}])


_ROLES = st.sampled_from(["user", "assistant", "tool", "system"])
_TEXT = st.lists(
    st.sampled_from(
        ["a", "b ", "\n", "ü", "{", '"', "<think>", "</think>", "<tool_response>", "</tool_response>"]
    ),
    max_size=6,
).map("".join)
_CALL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.sampled_from(["Bash", "Read"]),
                "arguments": st.one_of(
                    st.dictionaries(st.sampled_from(["a", "b"]), _TEXT, max_size=2), _TEXT
                ),
            }
        ),
    }
)


@st.composite
def _conversations(draw):
    msgs = []
    for _ in range(draw(st.integers(1, 7))):
        role = draw(_ROLES)
        m = {"role": role, "content": draw(_TEXT)}
        if role == "assistant" and draw(st.booleans()):
            m["tool_calls"] = draw(st.lists(_CALL, min_size=1, max_size=2))
        if role == "assistant" and draw(st.booleans()):
            m["reasoning_content"] = draw(_TEXT)
        msgs.append(m)
    return msgs


@settings(max_examples=300, deadline=None)
@given(
    msgs=_conversations(), tools=st.booleans(), gen=st.booleans(), think=st.sampled_from([None, True, False])
)
def test_native_qwen3_renderer_equals_the_jinja_template(chat, msgs, tools, gen, think):
    assert chat.native
    t = [{"type": "function", "function": {"name": "Bash", "parameters": {}}}] if tools else None
    kw = {} if think is None else {"enable_thinking": think}
    if msgs and msgs[0]["role"] == "system" and not isinstance(msgs[0]["content"], str):
        return
    assert chat.render(msgs, t, gen, **kw) == chat._jinja(msgs, t, gen, **kw)


def test_other_templates_are_rendered_by_jinja(tmp_path):
    d = build_tiny_tokenizer(tmp_path / "tok")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    other = ChatTokenizer(d)
    assert not other.native
    assert other.render([{"role": "user", "content": "hi"}]) == "[user]hi"
