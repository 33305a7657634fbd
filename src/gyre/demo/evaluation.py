"""What the demo policy does before RL, measured in this process: the agent loop against the model, no proxy, no engine.

`evaluate_policy(model_dir)` plays queries of the demo's task family with the built policy (`gyre.demo.model`) and
reports its mean reward, how often it reaches the end of a chain, calls per execution, the share of well-formed tool
calls and context resets. Requests are encoded exactly as the TITO proxy encodes them, so what it measures is what the
demo run starts from. Kept apart from the build: it is not part of what the build's cache key hashes.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from gyre import tasks
from gyre.demo import agent
from gyre.demo.model import DemoPolicyConfig

__all__ = ["evaluate_policy"]


class _InProcessPolicy:
    """A `complete` for the agent loop that samples from a model in this process, encoding each request exactly as
    the proxy does (earlier outputs spliced in verbatim) and answering as the proxy does (OpenAI shape)."""

    def __init__(self, model, chat, generator, temperature: float, max_tokens: int) -> None:
        self.model, self.chat, self.generator = model, chat, generator
        self.temperature, self.max_tokens = temperature, max_tokens
        self.outputs = self.tool_outputs = 0
        self.recorded: dict[str, list[int]] = {}  # tool-call id -> the output that holds it

    def _sample(self, prompt: list[int]) -> list[int]:
        import torch

        out: list[int] = []
        with torch.no_grad():
            ids, past = torch.tensor([prompt]), None
            for _ in range(self.max_tokens):
                step = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                past = step.past_key_values
                probs = torch.softmax(step.logits[0, -1].float() / self.temperature, -1)
                token = int(torch.multinomial(probs, 1, generator=self.generator))
                out.append(token)
                if token in self.chat.eos_ids:
                    break
                ids = torch.tensor([[token]])
        return out

    def __call__(self, messages: list[dict]) -> dict:
        from gyre_tito.parse import parse_output
        from gyre_tito.render import recorded_marker

        recorded: list[list[int]] = []
        template: list[dict] = []
        for m in messages:
            ids = [self.recorded[c["id"]] for c in m.get("tool_calls") or [] if c["id"] in self.recorded]
            if m["role"] == "assistant" and ids:
                recorded.append(ids[0])
                template.append({"role": "assistant", "content": recorded_marker(len(recorded) - 1)})
            else:
                template.append(m)
        text = self.chat.render(template, agent.TOOLS, add_generation_prompt=True)
        out = self._sample(list(self.chat.encode_rendered(text, recorded, [""] * len(recorded)).ids))
        parsed = parse_output(self.chat.decode(out))
        self.outputs += 1
        self.tool_outputs += bool(parsed.tool_calls)
        calls = []
        for j, c in enumerate(parsed.tool_calls):
            cid = f"call_{self.outputs}_{j}"
            self.recorded[cid] = out
            calls.append(
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
            )
        message: dict = {"role": "assistant", "content": parsed.text if (parsed.text or not calls) else None}
        if calls:
            message["tool_calls"] = calls
        return message


def evaluate_policy(
    model_dir: str | Path, episodes: int = 32, seed: int = 0, temperature: float = 1.0, threads: int = 1
) -> dict:
    """Play `episodes` queries with the policy in this process (no proxy, no engine): what it does before RL.

    Returns the mean reward, the share of executions that reached the end of their chain, model calls per
    execution, the share of outputs holding a well-formed tool call, and context resets per execution.

    `threads`: torch's intra-op threads while it plays (restored after). One by default: the demo policy's matmuls
    are tiny, and a second thread only adds synchronisation; measured on 2 cores, 32 episodes took 2.8 s of CPU on
    one thread and 9-17 s (7-24 s wall) on two, under load, with the same result."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _play(model_dir, episodes, seed, temperature)
    finally:
        torch.set_num_threads(before)


def _play(model_dir: str | Path, episodes: int, seed: int, temperature: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from gyre_tito.render import ChatTokenizer

    cfg = DemoPolicyConfig()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    policy = _InProcessPolicy(
        model, ChatTokenizer(model_dir), torch.Generator().manual_seed(seed), temperature, 40
    )
    rng = random.Random(f"gyre-demo-eval-{seed}")
    rewards, calls, resets = [], [], []
    with tempfile.TemporaryDirectory(prefix="gyre-demo-eval-") as tmp:
        for i in range(episodes):
            query = tasks.random_query(rng, f"eval-{i}")
            workspace = Path(tmp) / str(i)
            query.setup(workspace)
            result = agent.run_conversation(policy, workspace, query.prompt, cfg.max_turns, cfg.context_chars)
            rewards.append(tasks.score_answer(result.answer or "", query.codes))
            calls.append(result.calls)
            resets.append(result.resets)
    return {
        "episodes": episodes,
        "mean_reward": sum(rewards) / episodes,
        "solved": sum(r == 1.0 for r in rewards) / episodes,
        "calls_per_execution": sum(calls) / episodes,
        "tool_call_share": policy.tool_outputs / max(1, policy.outputs),
        "resets_per_execution": sum(resets) / episodes,
    }
