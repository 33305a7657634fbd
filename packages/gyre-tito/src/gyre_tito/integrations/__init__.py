"""gyre-tito inside other RL stacks: each module adapts a running proxy to one stack's rollout interface and imports
nothing of that stack when it is imported (it is handed the stack's objects, or builds its subclass of the stack's
class when that is first looked up), so gyre-tito installs alone.

- `gyre_tito.integrations.trl`: a TRL `GRPOTrainer(rollout_func=...)` that runs a harness per prompt through the
  proxy and trains the recorded tokens and behaviour log-probs.
- `gyre_tito.integrations.skyrl`: `TitoGenerator`, a SkyRL `GeneratorInterface` whose rows are the executions'
  selected trajectories (step-wise rows, one per admitted trajectory, where the tree holds several).
- `gyre_tito.integrations.verl`: `TitoAgentLoop`, a verl `AgentLoopBase` returning an execution's selected
  trajectory as an `AgentLoopOutput` (policy tokens mask 1, everything else 0).
- `gyre_tito.integrations.episode`: what the SkyRL and verl adapters share: `Episode`, the finished execution a
  reward function scores, and `run_episode`.
"""

from gyre_tito.integrations.session import TitoSession

__all__ = ["TitoSession"]
