"""gyre-tito inside other RL stacks: each module adapts a running proxy to one stack's rollout interface and imports
nothing of that stack (it is handed the stack's objects), so gyre-tito installs alone.

- `gyre_tito.integrations.trl`: a TRL `GRPOTrainer(rollout_func=...)` that runs a harness per prompt through the
  proxy and trains the recorded tokens and behaviour log-probs.
"""

from gyre_tito.integrations.session import TitoSession

__all__ = ["TitoSession"]
