"""Run in SkyRL's own environment by tests/test_tito_stacks.py (see it): SkyRL's real `GeneratorInterface`,
`TrajectoryID`, `validate_generator_output` and `convert_prompts_responses_to_batch_tensors` on what gyre-tito's
`TitoGenerator` returns for a tool-using harness run through a live proxy.

    python tito_skyrl_child.py PROXY_URL ADMIN_TOKEN OUT_JSON

Writes, per mode (`flat`: one row per prompt; `step_wise`: J_max=2 rows per prompt), the GeneratorOutput (trajectory
ids as strings), the executions in input order (as the reward function saw them), and the batch tensors SkyRL's
trainer builds from the rows (right-aligned `loss_masks`, `logprobs`, `rewards`). The parent checks the values."""

from __future__ import annotations

import asyncio
import json
import sys

from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
from skyrl.train.generators.base import BatchMetadata, GeneratorInterface, TrajectoryID
from skyrl.train.utils.trainer_utils import validate_generator_output
from tito_stack_harness import compacting_harness, harness, score

from gyre_tito.integrations import TitoSession
from gyre_tito.integrations.skyrl import TitoGenerator


def reward_from(seen: list[str]):
    def reward(episode) -> float:
        seen.append(episode.execution_id)
        return score(episode.prompt, episode.result) if episode.extras["env_class"] == "tito" else 0.0

    return reward


async def main(proxy_url: str, token: str, out_path: str) -> None:
    assert issubclass(TitoGenerator, GeneratorInterface)
    prompts, ids = [], []
    for instance, n in (("a", 3), ("b", 7)):
        for rep in range(2):  # SkyRL repeats each prompt n_samples_per_prompt times, with one instance id
            prompts.append([{"role": "user", "content": f"What is the square of {n}?"}])
            ids.append(TrajectoryID(instance_id=instance, repetition_id=rep))
    batch = {
        "prompts": prompts,
        "env_classes": ["tito"] * 4,
        "env_extras": [{"n": 1}] * 4,
        "sampling_params": None,
        "trajectory_ids": ids,
        "batch_metadata": BatchMetadata(global_step=1, training_phase="train"),
    }
    results = {}
    for mode, step_wise, h in (
        ("flat", False, harness),
        ("step_wise", True, compacting_harness),
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
            0,
            out["prompt_token_ids"],
            out["response_ids"],
            [
                [0.0] * (len(r) - 1) + [float(x)]
                for r, x in zip(out["response_ids"], out["rewards"], strict=True)
            ],
            out["loss_masks"],
            out["rollout_logprobs"],
        )
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
