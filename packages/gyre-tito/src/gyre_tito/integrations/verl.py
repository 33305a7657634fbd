"""gyre-tito as a verl agent loop: `TitoAgentLoop`, a `verl.experimental.agent_loop.agent_loop.AgentLoopBase`
(verl 0.9) that runs a harness per dataset row through the proxy.

verl instantiates an agent loop per sample (with `hydra.utils.instantiate`: the loop's config entry, plus verl's own
arguments) and calls `await run(sampling_params, **row)` with the dataset row's fields (`raw_prompt`, `uid`,
`extra_info`, `reward_model`, ...). Here the row becomes one gyre-tito execution: the harness runs `raw_prompt`
against the proxy with the execution's credential (any multi-turn agent: tool results, compaction and sub-agents are
recorded as they happen), the execution ends, and its highest-priority selected trajectory (J_max admission,
docs/design/tito.md#provenance-mask-and-selection) is returned as one `AgentLoopOutput`:

- `prompt_ids`: the trajectory's tokens before the policy's first output token;
- `response_ids`: the rest, the policy's outputs and what the harness put between them (tool results), cut to
  `rollout.response_length` as verl's own loops cut theirs;
- `response_mask`: 1 where the policy produced the token, 0 elsewhere;
- `response_logprobs`: the behaviour log-probs the engine reported (0.0 where the mask is 0), when verl asks for
  log-probs (`actor_rollout_ref.rollout.calculate_log_probs=True`), else None as verl's own loops return;
- `reward_score`: `reward(episode)` when a reward function is given (`gyre_tito.integrations.episode.Episode`: the
  prompt, the row's fields, what the harness returned, the trajectories), else None and verl's reward manager scores
  the decoded response;
- `num_turns`: 1 (the prompt) plus the runs of policy and non-policy tokens in the response;
- `extra_fields`: `execution_id` and `role_class`.

A prompt longer than `rollout.prompt_length` is refused (verl would cut its head off, and the policy's tokens would
then be trained on a context they were not sampled in). verl's sampling parameters do not reach the harness: its
requests (and the proxy) set them. The trainer's weights reach the engines behind the proxy by your setup's own
means; this module does not move weights.

Configure it with keyword arguments (a YAML entry at `actor_rollout_ref.rollout.agent.agent_loop_config_path`
gives them) or class attributes of a subclass registered with verl's `@register(name)`: `proxy_url`,
`admin_token` or `admin_token_file`, `harness` and `reward` (callables or import paths `"package.module:name"`),
`seed`. The harness is `harness(prompt, base_url, api_key)`, a plain function (run in a thread) or a coroutine
function; what it returns is `episode.result`.

Nothing of verl is imported when this module is: `TitoAgentLoop` is built as a subclass of verl's `AgentLoopBase` the
first time it is looked up (`from gyre_tito.integrations.verl import TitoAgentLoop`, or hydra resolving
`_target_: gyre_tito.integrations.verl.TitoAgentLoop`), so gyre-tito installs and imports without verl or torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from gyre_tito.integrations.episode import Episode, resolve, run_episode, stack_class
from gyre_tito.integrations.session import TitoSession
from gyre_tito.integrations.trl import split_trajectory

__all__ = [
    "TitoAgentLoopMixin",
    "count_turns",
]  # and TitoAgentLoop, built on first look-up (module __getattr__)


def count_turns(response_mask: list[int]) -> int:
    """verl's `num_turns` (user, assistant and tool turns): the prompt plus each run of equal mask values."""
    return 1 + sum(1 for i, m in enumerate(response_mask) if i == 0 or m != response_mask[i - 1])


class TitoAgentLoopMixin:
    """`run` for verl through a gyre-tito proxy (see the module docstring); `TitoAgentLoop` is this mixed into verl's
    `AgentLoopBase`. Keyword arguments override the class attributes of the same names."""

    proxy_url: str | None = None
    admin_token: str | None = None
    admin_token_file: str | None = None
    harness: Any = None
    reward: Any = None
    seed: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in ("proxy_url", "admin_token", "admin_token_file", "harness", "reward", "seed"):
            if name in kwargs:
                setattr(self, name, kwargs.pop(name))
        kwargs.pop("name", None)  # a YAML entry's own name, which verl passes on with the rest of the entry
        super().__init__(*args, **kwargs)
        token = self.admin_token
        if token is None and self.admin_token_file is not None:
            token = Path(self.admin_token_file).read_text().strip()
        if not self.proxy_url or not token or self.harness is None:
            raise ValueError(
                "TitoAgentLoop needs proxy_url, admin_token (or admin_token_file) and harness: give them in the "
                "agent loop's config entry or as class attributes of a subclass"
            )
        self.session = TitoSession(self.proxy_url, token)
        self.harness, self.reward = resolve(self.harness), resolve(self.reward)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

        prompt = kwargs["raw_prompt"]
        uid = kwargs.get("uid") or hashlib.sha256(repr(prompt).encode()).hexdigest()[:12]
        episode: Episode = await run_episode(
            self.session,
            self.harness,
            prompt,
            dict(kwargs),
            group_id=f"verl-{uid}",
            metadata={"source": "verl", "index": str(kwargs.get("index"))},
            j_max=1,
            seed=self.seed,
        )
        trajectory = episode.trajectories[0]
        prompt_ids, response_ids, logprobs, mask = split_trajectory(trajectory)
        limit = self.rollout_config.prompt_length
        if len(prompt_ids) > limit:
            raise ValueError(
                f"execution {episode.execution_id}: its prompt is {len(prompt_ids)} tokens, over "
                f"rollout.prompt_length={limit}; raise it (cutting the prompt would train the policy's tokens on "
                "a context they were not sampled in)"
            )
        n = self.rollout_config.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:n],
            response_mask=mask[:n],
            response_logprobs=logprobs[:n] if sampling_params.get("logprobs") else None,
            reward_score=float(self.reward(episode)) if self.reward is not None else None,
            num_turns=count_turns(mask[:n]),
            metrics=AgentLoopMetrics(generate_sequences=episode.seconds),
            extra_fields={"execution_id": episode.execution_id, "role_class": trajectory["role_class"]},
        )


__getattr__ = stack_class(
    globals(), "TitoAgentLoop", TitoAgentLoopMixin, "verl.experimental.agent_loop.agent_loop:AgentLoopBase"
)
