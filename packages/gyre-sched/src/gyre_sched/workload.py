"""Workload models for the simulator: a seeded statistical model, or the executions of a recorded trace.

A plan says, for the i-th execution of the n-th dispatched group, how long it runs, how it ends, and when and how its
designated assessment finishes. Plans depend only on (seed, n, i), never on event order, so two policies on the same
seed see exactly the same executions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre_sched.config import WorkloadConfig
from gyre_sched.trace import iter_trace
from gyre_sched.types import AssessedStatus, Outcome


@dataclass(frozen=True, slots=True)
class ExecPlan:
    duration_s: float
    """Launch to termination."""
    outcome: Outcome
    assess_delay_s: float
    """Termination to final assessment (all evaluator attempts)."""
    status: AssessedStatus
    reroutes: int = 0
    """Reroutes whose cost ``duration_s`` already includes (a recorded execution's): the simulator charges its
    reroute penalty only for reroutes beyond these."""

    def __post_init__(self) -> None:
        if not (self.duration_s >= 0 and self.assess_delay_s >= 0 and self.reroutes >= 0):
            raise ValueError(
                f"invalid execution plan: duration_s={self.duration_s}, assess_delay_s={self.assess_delay_s}, "
                f"reroutes={self.reroutes} (all must be >= 0)"
            )


class StatisticalWorkload:
    """Per-query lognormal difficulty x per-execution lognormal spread, a common harness timeout that clusters
    terminations, rare complete failures (no_work) and hangs to the overall budget (excluded), evaluator latency
    (exponential per attempt) and failures retried within the overall budget."""

    def __init__(self, cfg: WorkloadConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self._cache: dict[int, list[ExecPlan]] = {}

    def plan(self, group_seq: int, index: int) -> ExecPlan:
        plans = self._cache.get(group_seq)
        if plans is None or index >= len(plans):
            plans = self._cache[group_seq] = self._group(group_seq, max(index + 1, 32))
        return plans[index]

    def _group(self, group_seq: int, n: int) -> list[ExecPlan]:
        c = self.cfg
        rng = np.random.default_rng([self.seed, group_seq])
        difficulty = c.query_median_s * math.exp(c.query_sigma * rng.standard_normal())
        if rng.random() < c.hard_query_rate:
            difficulty *= c.hard_query_factor
        spread = np.exp(c.exec_sigma * rng.standard_normal(n))
        kind = rng.random(n)
        eval_u = rng.random((n, 16))
        eval_lat = rng.exponential(c.eval_latency_s, (n, 16)) if c.eval_latency_s > 0 else np.zeros((n, 16))
        out = []
        for i in range(n):
            if kind[i] < c.failed_rate:
                duration, outcome = c.failed_at_s, "failed"
            elif kind[i] < c.failed_rate + c.overall_timeout_rate:
                out.append(ExecPlan(c.overall_budget_s, "overall_timeout", 0.0, "excluded"))
                continue
            else:
                duration = difficulty * float(spread[i])
                outcome = "completed"
                if duration >= c.harness_timeout_s:
                    duration, outcome = c.harness_timeout_s, "harness_timeout"
            t, status = duration, None
            for a in range(16):  # retries against the same preserved state, within the overall budget
                t += float(eval_lat[i, a])
                if t > c.overall_budget_s:
                    t, status = max(c.overall_budget_s, duration), "excluded"
                    break
                if eval_u[i, a] >= c.eval_failure_rate:
                    status = "no_work" if outcome == "failed" else "valid"
                    break
            out.append(ExecPlan(duration, outcome, t - duration, status or "excluded"))
        return out


class TraceWorkload:
    """Replays a recorded trace: the n-th dispatched group takes the executions of the recorded group n (cycling).

    A recorded duration (launch to terminate) is a measurement and is replayed as is. It includes whatever its
    recorded reroutes cost, which the trace cannot separate out: the plan carries the number of recorded reroutes, and
    the simulator charges its ``reroute_penalty_s`` only for reroutes beyond those. Executions the recording
    cancelled or withdrew, or that were still running when it ended, have no observed duration; they take their
    group's longest observed duration (a lower bound for a straggler), documented in README."""

    def __init__(self, path: str | Path) -> None:
        groups: list[list[str]] = []
        launch: dict[str, float] = {}
        term: dict[str, tuple[float, str]] = {}
        assessed: dict[str, tuple[float, str]] = {}
        reroutes: dict[str, int] = {}
        for obj in iter_trace(path):
            ev = obj["ev"]
            if ev == "dispatch":
                groups.append(list(obj["executions"]))
            elif ev == "launch":
                launch[obj["execution"]] = obj["t"]
            elif ev == "terminate":
                term[obj["execution"]] = (obj["t"], obj["outcome"])
            elif ev == "assessed":
                assessed[obj["execution"]] = (obj["t"], obj["status"])
            elif ev == "route":
                reroutes[obj["execution"]] = reroutes.get(obj["execution"], 0) + 1
        self.groups: list[list[ExecPlan]] = []
        for ids in groups:
            seen = [i for i in ids if i in launch and i in term and term[i][1] != "cancelled"]
            if not seen:
                continue
            longest = max(term[i][0] - launch[i] for i in seen)
            plans = []
            for i in ids:
                if i not in seen:
                    plans.append(ExecPlan(longest, "completed", 0.0, "valid"))
                    continue
                t_end, outcome = term[i]
                n = reroutes.get(i, 0)
                if outcome == "overall_timeout":
                    plans.append(ExecPlan(t_end - launch[i], "overall_timeout", 0.0, "excluded", n))
                    continue
                t_as, status = assessed.get(i, (t_end, "valid"))
                plans.append(ExecPlan(t_end - launch[i], outcome, t_as - t_end, status, n))  # type: ignore[arg-type]
            self.groups.append(plans)
        if not self.groups:
            raise ValueError(f"trace {path} holds no launched-and-terminated execution to replay")

    def plan(self, group_seq: int, index: int) -> ExecPlan:
        plans = self.groups[group_seq % len(self.groups)]
        return plans[index % len(plans)]


def make_workload(cfg: WorkloadConfig, seed: int) -> StatisticalWorkload | TraceWorkload:
    return TraceWorkload(cfg.trace) if cfg.trace else StatisticalWorkload(cfg, seed)
