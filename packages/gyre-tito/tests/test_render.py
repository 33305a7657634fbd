import pytest

from gyre_tito.render import ChatTokenizer, TemplateError, recorded_marker
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
    assert chat.encode_text(text) == whole
    assert chat.encode_text(text) == whole  # second time from the piece cache
    assert chat.decode(whole) == text


def test_recorded_outputs_are_spliced_verbatim(chat):
    # a non-canonical tokenization of the same text, as a sampler may produce: one id per byte-level piece
    out_text = "<think>\nplan\n</think>\n\nhello"
    canon = chat.encode_text(out_text)
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
    start = enc.policy.index(True)
    assert enc.ids[start : start + len(weird)] == weird
    assert sum(enc.policy) == len(weird)
    # the template's own <|im_end|> after the turn is not added twice
    assert enc.ids[start + len(weird)] != chat.im_end_id
    assert chat.decode(enc.ids).count("<|im_end|>") == 3
    # Qwen3 re-rendering would have dropped the reasoning of this earlier turn: splicing keeps the recorded tokens
    plain = chat.render([msgs[0], {"role": "assistant", "content": out_text}, msgs[2]])
    assert "plan" not in plain


def test_unknown_marker_and_template_errors_are_template_errors(chat):
    with pytest.raises(TemplateError):
        chat.encode_rendered(recorded_marker(3), [])
    with pytest.raises(TemplateError):
        chat.render([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": object()}])
