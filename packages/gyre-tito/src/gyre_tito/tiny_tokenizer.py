"""A tiny, offline, deterministic Qwen3-style tokenizer for tests, demos and CPU engines.

`build_tiny_tokenizer(out_dir)` trains a byte-level BPE in-process on a fixed built-in corpus and writes a
Hugging Face tokenizer directory (`tokenizer.json`, `tokenizer_config.json` with a Qwen3-style chat template,
`special_tokens_map.json`, `chat_template.jinja`) that `transformers.AutoTokenizer.from_pretrained` loads.
The total vocabulary, special tokens included, is `TINY_VOCAB_SIZE` (512), so a tiny model with
`vocab_size=512` covers every id. Byte-level BPE means every string round-trips, whatever the corpus.

Nothing here imports transformers (which pulls in torch when present); `load_tiny_tokenizer` returns a
`tokenizers.Tokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_VOCAB_SIZE = 512

# Order fixes the ids: specials come first, so <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2, ...
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# Qwen3's chat template (tools in the system turn, JSON tool calls, merged <tool_response> user turns,
# <think> kept only for assistant turns after the last real user query), restated for this tokenizer.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Fixed training corpus: the kinds of text an agent transcript holds (chat scaffolding, JSON tool calls, shell,
# Python, prose). Its content only shapes the merges; byte-level BPE encodes any string. Public: the demo model's
# tokenizer (gyre.demo.model) trains on it too.
CORPUS: tuple[str, ...] = (
    "system\nYou are a helpful assistant. You are an interactive agent that helps users with software engineering tasks.",
    "user\nPlease write a file named hello.txt that contains the text hello world, then list the directory.",
    "assistant\nI will create the file and then list the directory to check that it is there.",
    '{"name": "Bash", "arguments": {"command": "ls -la", "description": "List files"}}',
    '{"name": "Write", "arguments": {"file_path": "/tmp/work/hello.txt", "content": "hello world\\n"}}',
    '{"name": "Read", "arguments": {"file_path": "/tmp/work/main.py"}}',
    '{"name": "Edit", "arguments": {"file_path": "main.py", "old_string": "return 1", "new_string": "return 2"}}',
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}',
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "For each function call, return a json object with function name and arguments within XML tags.",
    "def main(argv=None):\n    parser = argparse.ArgumentParser()\n    args = parser.parse_args(argv)\n    return 0\n",
    "import json\nfrom pathlib import Path\n\nfor line in Path('data.txt').read_text().splitlines():\n    print(line)\n",
    "$ cat hello.txt\nhello world\n$ echo done\ndone\n$ python -m pytest -q\n3 passed in 0.12s\n",
    "The quick brown fox jumps over the lazy dog. The answer is 42. Done: the task is complete.",
    "total 8\ndrwxr-xr-x 2 root root 4096 Nov 30 12:00 .\n-rw-r--r-- 1 root root   12 Nov 30 12:00 hello.txt",
    "Let me think about this step by step. First, the file must exist; second, it must contain the text.",
    "This session is being continued from a previous conversation that ran out of context.",
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools. Summarize the conversation so far.",
    'error: command not found\nTraceback (most recent call last):\n  File "main.py", line 1, in <module>',
    "<system-reminder>\nThe user opened the file in the IDE. This may or may not be related.\n</system-reminder>",
)


def _train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    # Repeat the corpus so merge counts are well separated; ordering is fixed, so training is deterministic.
    tok.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    return tok


def _tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_tiny_tokenizer(out_dir: str | Path) -> Path:
    """Train the tiny tokenizer and write it as a Hugging Face tokenizer directory; returns `out_dir`.

    Same bytes on every call and machine (fixed corpus, fixed trainer settings, sorted JSON)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train()
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > TINY_VOCAB_SIZE:  # guards the tiny model's embedding size
        raise RuntimeError(f"tiny tokenizer has {n} ids, more than {TINY_VOCAB_SIZE}")
    tok.save(str(out / "tokenizer.json"), pretty=False)
    cfg = _tokenizer_config()
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    specials = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": cfg["additional_special_tokens"],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE)
    return out


def load_tiny_tokenizer(path: str | Path) -> Tokenizer:
    """The `tokenizers.Tokenizer` from a directory written by `build_tiny_tokenizer` (no transformers, no torch)."""
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def special_token_id(tok: Tokenizer, token: str) -> int:
    """The single id of a special token such as `<|im_end|>`; raises KeyError if it is not one id."""
    tid = tok.token_to_id(token)
    if tid is None:
        raise KeyError(f"{token!r} is not a single token in this tokenizer")
    return tid
