"""Run in verl's own environment by tests/test_tito_stacks.py (see it): gyre-tito's `TitoAgentLoop` inside verl
0.9's real agent-loop machinery, through a live proxy.

    python tito_verl_child.py PROXY_URL ADMIN_TOKEN TOKENIZER_DIR WORK_DIR OUT_JSON

The loop is registered both ways verl offers: a YAML entry (what `actor_rollout_ref.rollout.agent.agent_loop_config_path`
names: `_target_` plus the loop's settings, read as verl's `AgentLoopWorker` reads it) and a subclass under
`@register`. verl's own `AgentLoopWorker._run_agent_loop` instantiates each loop (hydra, with verl's arguments), runs
it, and pads its `AgentLoopOutput`; `_postprocess` makes the batch the trainer gets. The worker is verl's class with
the attributes those two methods read (its constructor loads a model config and Ray handles, which a CPU test has
not got). Writes the batch's tensors and non-tensor fields for the parent to check."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf
from tito_stack_harness import episode_reward, harness
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopWorker,
    _agent_loop_registry,
    register,
)

from gyre_tito.integrations.verl import TitoAgentLoop

PROMPT_LENGTH, RESPONSE_LENGTH = 256, 192


@register("tito_subclass")
class SquaresLoop(TitoAgentLoop):
    """A user's loop: the settings as class attributes, the harness and reward as methods."""

    def harness(self, prompt, base_url, api_key):
        return harness(prompt, base_url, api_key)

    def reward(self, episode):  # the row's dataset fields are the episode's extras
        return episode_reward(episode) * (1.0 if episode.extras["data_source"] == "squares" else 0.5)


async def main(proxy_url: str, token: str, tokenizer_dir: str, work: str, out_path: str) -> None:
    assert issubclass(TitoAgentLoop, AgentLoopBase)
    token_file = Path(work) / "tito-admin.token"
    token_file.write_text(token + "\n")
    SquaresLoop.proxy_url, SquaresLoop.admin_token_file = proxy_url, str(token_file)
    entries = Path(work) / "agent_loops.yaml"
    entries.write_text(
        "- name: tito_yaml\n"
        "  _target_: gyre_tito.integrations.verl.TitoAgentLoop\n"
        f"  proxy_url: {proxy_url}\n"
        f"  admin_token_file: {token_file}\n"
        "  harness: tito_stack_harness:harness\n"
        "  reward: tito_stack_harness:episode_reward\n"
    )
    for entry in OmegaConf.load(entries):  # as AgentLoopWorker.__init__ reads agent_loop_config_path
        _agent_loop_registry[entry.name] = entry

    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH}
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )
    worker = object.__new__(AgentLoopWorker)
    worker.__dict__.update(
        config=config,
        rollout_config=config.actor_rollout_ref.rollout,
        llm_client=None,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        processor=None,
        hf_model_type=None,
        dataset_cls=None,
        tools=[],
        mm_processor_kwargs={},
        reward_loop_worker_handles=None,
        distillation_enabled=False,
    )

    rows = []
    for i, (agent, n) in enumerate(
        (("tito_yaml", 3), ("tito_yaml", 3), ("tito_subclass", 7), ("tito_subclass", 7))
    ):
        rows.append(
            {
                "raw_prompt": [{"role": "user", "content": f"What is the square of {n}?"}],
                "uid": f"u{n}",
                "index": i // 2,
                "data_source": "squares",
                "agent_name": agent,
            }
        )
    sampling_params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    outputs = []
    for i, row in enumerate(rows):
        info = {"step": 1, "sample_index": row["index"], "rollout_n": i % 2, "validate": False}
        outputs.append(await worker._run_agent_loop(sampling_params, info, trace=False, **row))
    batch = worker._postprocess(outputs, input_non_tensor_batch=None, validate=False)
    out = {k: v.tolist() for k, v in batch.batch.items()}
    out["num_turns"] = batch.non_tensor_batch["__num_turns__"].tolist()
    out["execution_id"] = batch.non_tensor_batch["execution_id"].tolist()
    out["role_class"] = batch.non_tensor_batch["role_class"].tolist()
    out["metrics"] = batch.meta_info["metrics"]
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
