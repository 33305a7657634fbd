"""gyre-tito as SkyRL's generator: return `TitoGenerator(session, harness, reward)` from your `BasePPOExp.get_generator`.

`TitoGenerator` is a `skyrl.train.generators.base.GeneratorInterface` (SkyRL 0.4). SkyRL calls `await
generate(input_batch)` with a `GeneratorInput` (`prompts`, `env_classes`, `env_extras`, `trajectory_ids`,
`batch_metadata`, ...; each prompt already repeated `n_samples_per_prompt` times) and trains the `GeneratorOutput` it
returns. Here each prompt becomes one gyre-tito execution: the harness runs it against the proxy with the execution's
credential (any multi-turn agent: tool results, compaction and sub-agents are recorded as they happen), the execution
ends, `reward(episode)` scores it (`gyre_tito.integrations.episode.Episode`: the prompt, the env extras, what the
harness returned, the execution's trajectories) and its selected trajectories become rows:

- `prompt_token_ids`: a trajectory's tokens before the policy's first output token;
- `response_ids`: the rest, the policy's outputs and what the harness put between them (tool results);
- `loss_masks`: the trajectory's target mask there (1 where the policy produced the token, 0 elsewhere);
- `rollout_logprobs`: the behaviour log-probs the engine reported (0.0 where the mask is 0);
- `rewards`: the execution's reward, one float per row.

Without step-wise training (`generator.step_wise_trajectories=false`, the default) each execution gives one row, its
highest-priority trajectory, and `trajectory_ids`/`is_last_step` are None, as SkyRL's own generator leaves them. With
`step_wise=True` (set it with SkyRL's `generator.step_wise_trajectories=true`) each execution gives up to `j_max` rows,
one per admitted trajectory of its tree (J_max admission, docs/design/tito.md#provenance-mask-and-selection: the main
line, then compacted or sub-agent branches), adjacent, all with the input's trajectory id, `is_last_step` True on the
last; the reward is on that last row and 0.0 on the others (SkyRL broadcasts the last step's advantage to every step
of a trajectory and ignores earlier steps' rewards).

SkyRL's sampling parameters do not reach the harness: the harness's requests (and the proxy) set them. The trainer's
weights reach the engines behind the proxy by your setup's own means; this module does not move weights.

Nothing of SkyRL is imported when this module is: `TitoGenerator` is built as a subclass of SkyRL's
`GeneratorInterface` the first time it is looked up (`from gyre_tito.integrations.skyrl import TitoGenerator`), so
gyre-tito installs and imports without SkyRL or torch.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

from gyre_tito.integrations.episode import Episode, RewardFn, run_episode, stack_class
from gyre_tito.integrations.session import TitoSession
from gyre_tito.integrations.trl import split_trajectory

__all__ = [
    "TitoGeneratorMixin",
    "generator_rows",
]  # and TitoGenerator, built on first look-up (module __getattr__)


def generator_rows(
    episodes: list[Episode], rewards: list[float], trajectory_ids: list[Any] | None, *, step_wise: bool
) -> dict[str, Any]:
    """The `GeneratorOutput` of finished episodes (one per input prompt, in input order) and their rewards."""
    out: dict[str, Any] = {
        k: [] for k in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "rollout_logprobs")
    }
    out_ids: list[Any] = []
    is_last_step: list[bool] = []
    times: list[float] = []
    for i, (episode, reward) in enumerate(zip(episodes, rewards, strict=True)):
        rows = episode.trajectories if step_wise else episode.trajectories[:1]
        for j, trajectory in enumerate(rows):
            prompt_ids, response_ids, logprobs, mask = split_trajectory(trajectory)
            last = j == len(rows) - 1
            out["prompt_token_ids"].append(prompt_ids)
            out["response_ids"].append(response_ids)
            out["loss_masks"].append(mask)
            out["rollout_logprobs"].append(logprobs)
            out["rewards"].append(float(reward) if last else 0.0)
            is_last_step.append(last)
            out_ids.append(trajectory_ids[i] if trajectory_ids is not None else None)
            times.append(episode.seconds)
    targets = [sum(m) for m in out["loss_masks"]]
    out |= {
        "stop_reasons": None,
        "rollout_metrics": {
            "tito/rows_per_execution": len(targets) / len(episodes),
            "tito/avg_target_tokens": sum(targets) / len(targets),
            "tito/avg_response_length": sum(map(len, out["response_ids"])) / len(targets),
        },
        "trajectory_ids": out_ids if step_wise else None,
        "is_last_step": is_last_step if step_wise else None,
        "trajectory_generation_times": times,
        "trajectory_time_splits": None,
        "rollout_expert_indices": None,
        "rollout_sample_support": None,
        "env_metrics": None,
    }
    return out


class TitoGeneratorMixin:
    """`generate` for SkyRL through a gyre-tito proxy (see the module docstring); `TitoGenerator` is this mixed into
    SkyRL's `GeneratorInterface`.

    `harness(prompt, base_url, api_key)` runs one execution of a SkyRL prompt (chat messages) against the proxy and
    may return a result (plain function: run in a thread; or a coroutine function). `reward(episode) -> float`
    scores it. `concurrency` executions run at once. `j_max` bounds the rows per execution when `step_wise`. A
    harness that raises fails `generate` with its execution named; its execution is ended either way. `j_max`
    defaults to 1, or to 5 when `step_wise`."""

    def __init__(
        self,
        session: TitoSession,
        harness: Callable[..., Any],
        reward: RewardFn,
        *,
        step_wise: bool = False,
        j_max: int | None = None,
        concurrency: int = 8,
        seed: int = 0,
    ) -> None:
        if j_max is not None and j_max > 1 and not step_wise:
            raise ValueError(
                f"j_max={j_max} needs step_wise=True (generator.step_wise_trajectories): without step-wise "
                "training SkyRL takes one row per prompt"
            )
        self.session, self.harness, self.reward = session, harness, reward
        self.step_wise, self.j_max = step_wise, j_max if j_max is not None else (5 if step_wise else 1)
        self.concurrency, self.seed = concurrency, seed
        self.calls = 0

    async def generate(self, input_batch: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        prompts = input_batch["prompts"]
        env_classes = input_batch.get("env_classes") or [None] * len(prompts)
        env_extras = input_batch.get("env_extras") or [None] * len(prompts)
        trajectory_ids = input_batch.get("trajectory_ids")
        if self.step_wise and trajectory_ids is None:
            raise ValueError(
                "step-wise rows need the input's trajectory_ids (SkyRL's trainer always gives them)"
            )
        metadata = input_batch.get("batch_metadata")
        step = getattr(metadata, "global_step", self.calls)
        phase = getattr(metadata, "training_phase", "train")
        gate = asyncio.Semaphore(max(1, self.concurrency))

        async def one(i: int) -> Episode:
            if trajectory_ids is not None:
                tid = trajectory_ids[i]
                instance, name = tid.instance_id, tid.to_string()
            else:
                instance = name = hashlib.sha256(repr(prompts[i]).encode()).hexdigest()[:12]
            extras = {**(env_extras[i] or {}), "env_class": env_classes[i]}
            async with gate:
                return await run_episode(
                    self.session,
                    self.harness,
                    prompts[i],
                    extras,
                    group_id=f"skyrl-{phase}-{step}-{instance}",
                    metadata={"source": "skyrl", "trajectory_id": name},
                    j_max=self.j_max,
                    seed=self.seed,
                )

        episodes = list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        rewards = [float(self.reward(e)) for e in episodes]
        return generator_rows(episodes, rewards, trajectory_ids, step_wise=self.step_wise)


__getattr__ = stack_class(
    globals(), "TitoGenerator", TitoGeneratorMixin, "skyrl.train.generators.base:GeneratorInterface"
)
