"""gyre-tito as TRL's rollout (issue 40): TRL's own `GRPOTrainer` trains a tiny model on CPU for two steps on what a
tool-using harness (the `openai` SDK, two model calls with a tool result between them) recorded through the proxy.
Every completion token TRL trains is a token the engine produced, in the recorded order, with the recorded behaviour
log-prob; the tool result between the calls is in the completion but masked out (`env_mask` 0).

The engine is gyre-tito's scripted engine (deterministic replies with known log-probs, a real HTTP server); the
proxy, the harness, TRL's trainer and the model are the real ones."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from gyre_cell.tiny_model import build_tiny_model
from gyre_tito.integrations import TitoSession
from gyre_tito.integrations.trl import TitoRollout
from gyre_tito.proxy import ProxyConfig
from gyre_tito.records import log_path as record_log
from gyre_tito.records import read_log
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig
from gyre_tito.testing import ProxyServer

pytestmark = pytest.mark.slow

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


ANSWERS = itertools.count()


def reply(prompt: str, last: str) -> str:
    n = int(re.findall(r"square of (\d+)", prompt)[-1])
    # numbered: every execution's outputs differ, so each trained row names its own
    if "<tool_response>" in last:
        return f"The square of {n} is {n * n} (answer {next(ANSWERS)})."
    return f'<tool_call>\n{{"name": "square", "arguments": {{"n": {n}}}}}\n</tool_call>'


def harness(prompt: str, base_url: str, api_key: str) -> None:
    """An agent loop as a user writes one: call the model, run the tools it asks for, until it answers."""
    import openai  # inside: collection imports no model SDK (tests/test_collection_imports.py)

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": prompt}]
    for _ in range(4):
        msg = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48)
        message = msg.choices[0].message
        if not message.tool_calls:
            return
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [c.model_dump() for c in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            n = int(re.findall(r"\d+", call.function.arguments)[0])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(n * n)})


def test_trl_trains_exactly_the_recorded_tokens_and_behaviour_logprobs(tmp_path, monkeypatch):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model_dir = build_tiny_model(tmp_path / "model")
    engine = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(model_dir)), reply_fn=reply)
    store = tmp_path / "store"
    config = ProxyConfig(
        engines=[engine.start()], tokenizer=str(model_dir), store=str(store), admin_token="adm"
    )
    rewarded: list[str] = []

    def reward(prompts, completions, execution_id, **_):
        rewarded.extend(execution_id)
        return [float(i % 2) for i in range(len(completions))]  # unequal within a group: non-zero advantages

    trained: list[dict[str, torch.Tensor]] = []
    try:
        with ProxyServer(config) as proxy:
            rollout = TitoRollout(TitoSession(proxy.url, "adm"), harness, concurrency=2)
            args = GRPOConfig(
                output_dir=str(tmp_path / "trl"),
                per_device_train_batch_size=2,
                num_generations=2,
                max_steps=2,
                learning_rate=1e-3,
                beta=0.0,
                logging_steps=1,
                report_to="none",
                save_strategy="no",
                use_cpu=True,
                bf16=False,
                seed=0,
                dataloader_num_workers=0,
            )
            data = Dataset.from_list([{"prompt": f"What is the square of {n}?"} for n in (3, 7, 12, 25)])
            trainer = GRPOTrainer(
                model=str(model_dir), reward_funcs=reward, args=args, train_dataset=data, rollout_func=rollout
            )
            compute_loss = trainer.compute_loss

            def spy(model, inputs, *a, **kw):
                keep = ("completion_ids", "completion_mask", "tool_mask", "sampling_per_token_logps")
                trained.append({k: inputs[k].detach().clone() for k in keep})
                return compute_loss(model, inputs, *a, **kw)

            trainer.compute_loss = spy
            before = [p.detach().clone() for p in trainer.model.parameters()]
            trainer.train()
            assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    finally:
        engine.stop()

    # what each execution recorded: its calls' outputs and behaviour log-probs, in order
    recorded = {}
    for eid in set(rewarded):
        calls = read_log(record_log(store / "records", eid)).records
        assert (
            len(calls) == 2 and calls[0].metadata["tool_call_ids"] and not calls[1].metadata["tool_call_ids"]
        )
        recorded[eid] = calls
    rows = [
        {k: v[i] for k, v in batch.items()} for batch in trained for i in range(len(batch["completion_ids"]))
    ]
    assert len(recorded) == len(rewarded) == len(rows) == 2 * 2  # 2 steps x 1 prompt x 2 generations
    matched = set()
    for row in rows:
        n = int(row["completion_mask"].sum())
        ids, mask = row["completion_ids"][:n].tolist(), row["tool_mask"][:n].tolist()
        logprobs = row["sampling_per_token_logps"][:n]
        policy_ids = [t for t, m in zip(ids, mask, strict=True) if m]
        owner = [e for e, calls in recorded.items() if [t for c in calls for t in c.output_ids] == policy_ids]
        assert owner, "a trained completion no execution recorded"
        calls = recorded[owner[0]]
        matched.add(owner[0])
        expected = torch.tensor([lp for c in calls for lp in c.output_logprobs])
        assert torch.allclose(logprobs[torch.tensor(mask, dtype=torch.bool)], expected, atol=1e-6)
        assert 0 in mask  # the tool result between the two calls: trained as context, never as a target
        # it starts with the first call's output
        assert ids[: len(calls[0].output_ids)] == calls[0].output_ids
    assert matched == set(rewarded)  # every execution trained once, each row its own
