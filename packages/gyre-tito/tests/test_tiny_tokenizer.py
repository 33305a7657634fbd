import subprocess
import sys

import pytest

from gyre_tito.tiny_tokenizer import (
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    build_tiny_tokenizer,
    load_tiny_tokenizer,
    special_token_id,
)


def test_build_is_deterministic_and_fits_vocab(tmp_path):
    a = build_tiny_tokenizer(tmp_path / "a")
    b = build_tiny_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    tok = load_tiny_tokenizer(a)
    assert tok.get_vocab_size(with_added_tokens=True) == TINY_VOCAB_SIZE
    assert max(tok.get_vocab().values()) == TINY_VOCAB_SIZE - 1


def test_specials_are_single_ids_and_text_round_trips(tmp_path):
    tok = load_tiny_tokenizer(build_tiny_tokenizer(tmp_path))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert special_token_id(tok, s) == i
        assert tok.encode(s, add_special_tokens=False).ids == [i]
    text = '<|im_start|>user\nwörld 🎉 {"a": 1}<|im_end|>\n<tool_call>\n{}\n</tool_call><think>x</think>'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Specials split the text, so encoding pieces cut at special tokens equals encoding the whole.
    pieces = ["<|im_start|>", 'user\nwörld 🎉 {"a": 1}', "<|im_end|>", "\n", "<tool_call>"]
    cat = [t for p in pieces for t in tok.encode(p, add_special_tokens=False).ids]
    assert cat == tok.encode("".join(pieces), add_special_tokens=False).ids


@pytest.mark.slow
def test_transformers_loads_it_with_qwen3_chat_template(tmp_path):
    out = build_tiny_tokenizer(tmp_path)
    # transformers pulls in torch when installed; run it in a child so this process stays torch-free.
    code = f"""
import json
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained({str(out)!r})
msgs = [
    {{"role": "system", "content": "sys"}},
    {{"role": "user", "content": "hi"}},
    {{"role": "assistant", "content": "", "tool_calls": [
        {{"type": "function", "function": {{"name": "Bash", "arguments": {{"command": "ls"}}}}}}]}},
    {{"role": "tool", "content": "a.txt"}},
    {{"role": "tool", "content": "b"}},
    {{"role": "assistant", "content": "<think>\\nhmm\\n</think>\\n\\ndone"}},
]
tools = [{{"type": "function", "function": {{"name": "Bash", "parameters": {{}}}}}}]
s = t.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
print(json.dumps({{"s": s, "eos": t.eos_token_id, "pad": t.pad_token_id, "n": len(t)}}))
"""
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    got = __import__("json").loads(res.stdout.strip().splitlines()[-1])
    assert got["eos"] == 2 and got["pad"] == 0 and got["n"] == TINY_VOCAB_SIZE
    s = got["s"]
    assert s.startswith("<|im_start|>system\nsys\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "Bash", "parameters": {}}}\n</tools>' in s
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        in s
    )
    assert (
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\nb\n</tool_response><|im_end|>\n"
        in s
    )
    # The last assistant turn is after the last user query, so its reasoning is kept.
    assert s.endswith(
        "<|im_start|>assistant\n<think>\nhmm\n</think>\n\ndone<|im_end|>\n<|im_start|>assistant\n"
    )
