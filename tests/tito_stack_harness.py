"""The agent that tests/tito_skyrl_child.py and tests/tito_verl_child.py run through gyre-tito's adapters (in the
stacks' own environments: httpx only): OpenAI chat completions with one tool. The model asks for `square`, gets its
result, answers; with `compact`, the agent then starts a fresh context from a summary and asks again (a second branch
of the execution's tree). Returns the last answer. The engine's replies are tests/test_tito_stacks.py's `reply`."""

from __future__ import annotations

import json
import re

import httpx

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "square",
            "description": "The square of n.",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        },
    }
]


def harness(messages: list[dict], base_url: str, api_key: str, compact: bool = False) -> str:
    headers = {"Authorization": f"Bearer {api_key}"}

    def call(msgs: list[dict]) -> dict:
        body = {"model": "policy", "messages": msgs, "tools": TOOLS, "max_tokens": 48}
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]

    msgs = list(messages)
    while (message := call(msgs)).get("tool_calls"):
        msgs.append(
            {"role": "assistant", "content": message.get("content"), "tool_calls": message["tool_calls"]}
        )
        for c in message["tool_calls"]:
            n = json.loads(c["function"]["arguments"])["n"]
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": str(n * n)})
    if compact:
        summary = f"Summary: {messages[-1]['content']} The tool said {msgs[-1]['content']}."
        message = call([{"role": "user", "content": summary}])
    return message["content"]


def compacting_harness(messages: list[dict], base_url: str, api_key: str) -> str:
    return harness(messages, base_url, api_key, compact=True)


def score(prompt: list[dict], answer: str) -> float:
    """1.0 when the answer holds the square the prompt asks for."""
    n = int(re.findall(r"square of (\d+)", prompt[-1]["content"])[0])
    return 1.0 if str(n * n) in answer else 0.0


def episode_reward(episode) -> float:
    """A reward function as the adapters call it: `gyre_tito.integrations.episode.Episode` -> float."""
    return score(episode.prompt, episode.result)
