from gyre_tito.parse import parse_output


def test_text_reasoning_and_tool_calls():
    raw = '<think>\nI should list.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>\n<tool_call>\n{"name": "Read", "arguments": "{\\"file_path\\": \\"a\\"}"}\n</tool_call><|im_end|>'
    p = parse_output(raw)
    assert p.reasoning == "I should list."
    assert p.text == "Let me look."
    assert [(c.name, c.arguments) for c in p.tool_calls] == [
        ("Bash", {"command": "ls"}),
        ("Read", {"file_path": "a"}),
    ]
    assert p.tool_calls[0].raw == '{"name": "Bash", "arguments": {"command": "ls"}}'


def test_plain_text_truncated_reasoning_and_bad_tool_json():
    assert parse_output("hello<|im_end|>").text == "hello"
    p = parse_output("<think>\nhalf a thou")
    assert p.reasoning == "half a thou" and p.text == "" and not p.tool_calls
    p = parse_output("x <tool_call>\n{not json}\n</tool_call>")
    assert not p.tool_calls and "{not json}" in p.text
