"""Run in SkyRL's own environment by tests/test_tito_skyrl.py (see it): SkyRL's real `GeneratorInterface`,
`TrajectoryID`, `validate_generator_output` and `convert_prompts_responses_to_batch_tensors` on what gyre-tito's
`TitoGenerator` returns for a tool-using harness run through a live proxy.

    python tito_skyrl_child.py PROXY_URL ADMIN_TOKEN OUT_JSON

Writes, per mode (`flat`: one row per prompt; `step_wise`: J_max=2 rows per prompt), the GeneratorOutput (trajectory
ids as strings), the executions in input order (as the reward function saw them), and the batch tensors SkyRL's
trainer builds from the rows (right-aligned `loss_masks`, `logprobs`, `rewards`). The parent checks the values."""

from __future__ import annotations

import asyncio
import json
import re
import sys

import httpx
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
from skyrl.train.generators.base import BatchMetadata, GeneratorInterface, TrajectoryID
from skyrl.train.utils.trainer_utils import validate_generator_output

from gyre_tito.integrations import TitoSession
from gyre_tito.integrations.skyrl import TitoGenerator

TOOLS = [{"type": "function", "function": {
    "name": "square", "description": "The square of n.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
}}]  # fmt: skip


def harness(messages: list[dict], base_url: str, api_key: str, compact: bool = False) -> str:
    """The model asks for the tool, gets its result, answers; with `compact`, the agent then starts a fresh context
    from a summary and asks again (a second branch of the execution's tree). Returns the last answer."""
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


def reward_from(seen: list[str]):
    def reward(episode) -> float:
        seen.append(episode.execution_id)
        n = int(re.findall(r"square of (\d+)", episode.prompt[-1]["content"])[0])
        return 1.0 if str(n * n) in episode.result and episode.extras["env_class"] == "tito" else 0.0

    return reward


async def main(proxy_url: str, token: str, out_path: str) -> None:
    assert issubclass(TitoGenerator, GeneratorInterface)
    prompts, ids = [], []
    for instance, n in (("a", 3), ("b", 7)):
        for rep in range(2):  # SkyRL repeats each prompt n_samples_per_prompt times, with one instance id
            prompts.append([{"role": "user", "content": f"What is the square of {n}?"}])
            ids.append(TrajectoryID(instance_id=instance, repetition_id=rep))
    batch = {
        "prompts": prompts, "env_classes": ["tito"] * 4, "env_extras": [{"n": 1}] * 4, "sampling_params": None,
        "trajectory_ids": ids, "batch_metadata": BatchMetadata(global_step=1, training_phase="train"),
    }  # fmt: skip
    results = {}
    for mode, step_wise, h in (
        ("flat", False, harness),
        ("step_wise", True, lambda m, u, k: harness(m, u, k, compact=True)),
    ):
        seen: list[str] = []
        generator = TitoGenerator(
            TitoSession(proxy_url, token),
            h,
            reward_from(seen),
            step_wise=step_wise,
            j_max=2 if step_wise else 1,
        )
        out = await generator.generate(batch)
        validate_generator_output(len(prompts), out, step_wise=step_wise)  # SkyRL's own checks
        tensors = convert_prompts_responses_to_batch_tensors(
            0, out["prompt_token_ids"], out["response_ids"], [[0.0] * (len(r) - 1) + [float(x)]
            for r, x in zip(out["response_ids"], out["rewards"], strict=True)],
            out["loss_masks"], out["rollout_logprobs"],
        )  # fmt: skip
        _, _, response_mask, rewards_t, loss_masks_t, logprobs_t, _, _ = tensors
        if out["trajectory_ids"] is not None:
            out["trajectory_ids"] = [t.to_string() for t in out["trajectory_ids"]]
        results[mode] = {
            "output": out,
            "executions": seen,
            "tensors": {
                "response_mask": response_mask.tolist(),
                "loss_masks": loss_masks_t.tolist(),
                "logprobs": logprobs_t.tolist(),
                "rewards": rewards_t.tolist(),
            },
        }
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
