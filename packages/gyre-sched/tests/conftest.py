"""Small, fast simulator configurations shared by the tests."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gyre_sched.config import SimConfig
from gyre_sched.presets import deep_merge

SMALL: dict[str, Any] = {
    "seed": 3,
    "policy": {"N": 4, "B": 8, "rho_min": 0.5, "tau_s": 30.0, "async_train_cells": 1},
    "cluster": {"nodes": 4, "nodes_per_cell": 1, "slots_per_node": 12},
    "workload": {
        "query_median_s": 1800.0,
        "query_sigma": 0.4,
        "exec_sigma": 0.4,
        "harness_timeout_s": 5400.0,
        "overall_budget_s": 7200.0,
        "eval_latency_s": 60.0,
    },
    "cost": {
        "train_node_s_per_group": 300.0,
        "microsteps_per_group": 4,
        "pipeline_startup_s": 20.0,
        "pipeline_drain_s": 20.0,
        "optimizer_s": 20.0,
        "broadcast_s": 10.0,
        "switch_to_training_s": 8.52,
        "switch_to_rollout_s": 3.46,
        "satellite_join_s": 20.0,
        "publish_s": 60.0,
        "reroute_penalty_s": 5.0,
    },
}


def make_small(kind: str, phi: float, mu: int, *, bursts: int = 12, **over: Any) -> SimConfig:
    warm = math.ceil(phi) + 1
    raw = deep_merge(
        SMALL,
        {
            "steps": mu * (bursts + warm),
            "warmup_bursts": warm,
            "policy": {"kind": kind, "phi": phi, "mu": mu},
        },
    )
    return SimConfig.model_validate(deep_merge(raw, over))


@pytest.fixture
def small():
    return make_small


class Driver:
    """Drives a policy by hand: remembers launches and applies decisions the way a controller would."""

    def __init__(self, policy) -> None:
        from gyre_sched.events import BeginTransition, Cancel, Launch, Publish

        self._types = (BeginTransition, Cancel, Launch, Publish)
        self.policy = policy
        self.now = 0.0
        self.log: list = []
        self.running: list[str] = []
        self.cancelled: list[str] = []
        self.switching: set[int] = set()
        self.publishing: int | None = None
        self._apply(policy.start(0.0))

    def _apply(self, out: list) -> list:
        BeginTransition, Cancel, Launch, Publish = self._types
        self.log += out
        for d in out:
            if isinstance(d, Launch):
                self.running.append(d.spec.execution_id)
            elif isinstance(d, Cancel):
                self.cancelled.append(d.execution_id)
            elif isinstance(d, BeginTransition):
                self.switching.add(d.cell)
            elif isinstance(d, Publish):
                self.publishing = d.version
        return out

    def send(self, ev, dt: float = 0.0) -> list:
        self.now += dt
        return self._apply(self.policy.handle(ev, self.now))

    def finish(self, eid: str, outcome: str = "completed", status: str | None = "valid") -> list:
        from gyre_sched.events import Assessed, Terminated

        self.running.remove(eid)
        out = self.send(Terminated(eid, outcome))
        if status is not None and outcome not in ("overall_timeout", "cancelled"):
            out += self.send(Assessed(eid, status))
        return out

    def settle_cancels(self) -> None:
        from gyre_sched.events import Terminated

        while self.cancelled:
            eid = self.cancelled.pop()
            self.running.remove(eid)
            self.send(Terminated(eid, "cancelled"))

    def finish_transitions(self) -> None:
        from gyre_sched.events import TransitionDone

        while self.switching:
            cell = min(self.switching)
            self.switching.discard(cell)
            self.send(TransitionDone(cell))

    def of(self, cls) -> list:
        return [d for d in self.log if isinstance(d, cls)]


@pytest.fixture
def driver():
    return Driver
