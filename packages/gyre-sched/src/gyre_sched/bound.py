"""The ideal bound of boundary dispatch: only dispatch's tail is left.

``ideal_config(cfg)`` is the same run (workload, seed, N, B, phi, mu, spares, planner) with unlimited rollout capacity
and free training: one training cell that trains a group in no time, a standalone pool that launches every execution
the moment it is dispatched, no switch, optimizer, broadcast, publication or reroute cost. A step then ends the moment
its B-th group is ready, and a burst's dispatch waits only for the burst's last step: what remains is the time groups
take to become ready (their longest execution plus evaluation) under boundary dispatch. No policy on the real cluster
can be faster on the same executions, up to the order in which refills take plans.
"""

from __future__ import annotations

from typing import Any

from gyre_sched.config import SimConfig
from gyre_sched.sim import SimResult, Simulator

_FREE = (
    "pipeline_startup_s", "pipeline_drain_s", "optimizer_s", "broadcast_s", "switch_to_training_s",
    "switch_to_rollout_s", "satellite_join_s", "publish_s", "reroute_penalty_s",
)  # fmt: skip


def ideal_config(cfg: SimConfig) -> SimConfig:
    """``cfg`` with unlimited capacity and free training (see module docstring)."""
    d: dict[str, Any] = cfg.model_dump()
    d["name"] = f"{cfg.name}-bound"
    d["policy"].update(kind="async", async_train_cells=1, streaming=True)
    d["cluster"].update(nodes=d["cluster"]["nodes_per_cell"], standalone_nodes=0, C_s=10**9)
    d["cost"].update(
        {k: 0.0 for k in _FREE}, train_node_s_per_group=1e-9, microsteps_per_group=1, microstep_overhead_s=0.0
    )
    d["workload"]["cancel_latency_s"] = 0.0
    return SimConfig.model_validate(d)


def ideal_bound(cfg: SimConfig) -> SimResult:
    """Simulate the ideal bound of ``cfg``."""
    return Simulator(ideal_config(cfg)).run()
