"""gyre-tito as TRL's rollout: `GRPOTrainer(..., rollout_func=TitoRollout(session, harness))`.

TRL calls `rollout_func(prompts, trainer)` with its per-process batch (each prompt already repeated
`num_generations` times) and trains what it returns: `prompt_ids`, `completion_ids`, `logprobs`, and `env_mask` (0 for
tokens the policy did not produce). Here each prompt becomes one gyre-tito execution: the harness runs it against the
proxy with the execution's credential (any multi-turn agent: tool results, compaction and sub-agents are recorded as
they happen), the execution ends, and its highest-priority selected trajectory is returned:
- `prompt_ids`: the trajectory's tokens before the policy's first output token;
- `completion_ids`: the rest, the policy's outputs and what the harness put between them (tool results);
- `env_mask`: the trajectory's target mask there (1 where the policy produced the token, 0 elsewhere);
- `logprobs`: the behaviour log-probs the engine reported for those tokens (0.0 where `env_mask` is 0);
- `execution_id`, `role_class`: forwarded by TRL to the reward functions as keyword arguments.

So TRL trains exactly the recorded tokens with their recorded behaviour log-probs, however the harness re-rendered
its messages. The trainer's weights reach the engines behind the proxy by whatever the user's setup does (TRL's
vLLM server, a file the engine reloads); this module does not move weights. Nothing of TRL is imported here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gyre_tito.integrations.session import TitoSession

__all__ = ["Harness", "TitoRollout", "split_trajectory"]

Harness = Callable[[Any, str, str], None]
"""`harness(prompt, base_url, api_key)`: run one execution of `prompt` (TRL's prompt, a string or chat messages)
against the proxy at `base_url` (its Anthropic `/v1/messages` and OpenAI `/v1/chat/completions`), authenticating
with `api_key`; return when the execution is over."""


def split_trajectory(trajectory: dict[str, Any]) -> tuple[list[int], list[int], list[float], list[int]]:
    """(prompt_ids, completion_ids, logprobs, env_mask) of one exported trajectory, split before its first target."""
    ids, mask, logprobs = trajectory["token_ids"], trajectory["target_mask"], trajectory["behavior_logprobs"]
    if 1 not in mask:
        raise ValueError(
            f"execution {trajectory['execution_id']}: its trajectory has no policy output to train"
        )
    k = mask.index(1)
    return list(ids[:k]), list(ids[k:]), list(logprobs[k:]), list(mask[k:])


class TitoRollout:
    """A TRL `rollout_func` running `harness` once per prompt through a gyre-tito proxy (see the module docstring).

    `concurrency` executions run at once (threads: a harness mostly waits on the model and its tools). A harness
    that raises fails the rollout with the execution named; its execution is ended either way."""

    def __init__(
        self, session: TitoSession, harness: Harness, *, concurrency: int = 8, seed: int = 0
    ) -> None:
        self.session, self.harness = session, harness
        self.concurrency, self.seed = concurrency, seed
        self.calls = 0

    def _one(self, prompt: Any, group_id: str) -> dict[str, Any]:
        eid, credential = self.session.open(group_id, {"source": "trl"})
        try:
            self.harness(prompt, self.session.proxy_url, credential)
        except Exception as exc:
            raise RuntimeError(f"execution {eid}: the harness failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self.session.end(eid)
        trajectories = self.session.trajectories(eid, j_max=1, seed=self.seed)
        if not trajectories:
            raise RuntimeError(f"execution {eid}: the harness made no model call through the proxy")
        return trajectories[0]

    def __call__(self, prompts: Sequence[Any], trainer: Any = None) -> dict[str, list[Any]]:
        self.calls += 1
        groups = [f"trl-{self.calls}-{hashlib.sha256(repr(p).encode()).hexdigest()[:12]}" for p in prompts]
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            trajectories = list(pool.map(self._one, prompts, groups))
        out: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        for t in trajectories:
            for key, value in zip(out, split_trajectory(t), strict=True):
                out[key].append(value)
        out["execution_id"] = [t["execution_id"] for t in trajectories]
        out["role_class"] = [t["role_class"] for t in trajectories]
        return out
