"""Workload models for the simulator: a seeded statistical model, or the executions of a recorded trace.

A plan says, for the i-th execution of the n-th dispatched group, how long it runs, how it ends, and when and how its
designated assessment finishes. Plans depend only on (seed, n, i), never on event order, so two policies on the same
seed see exactly the same executions.
"""

from __future__ import annotations

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
    evaluation: tuple[tuple[float, bool], ...] = ()
    """The evaluator's attempts as drawn, (latency, succeeded) each, the last one cut by the overall budget where it
    ran out (what `gyre_eval.testing.WorkloadEvaluator` plays in a real run; empty for a replayed trace)."""
    stall_at_s: float | None = None
    """A hang that becomes known by stalling: when it makes its last model call (its watchdog ends it at
    ``duration_s``)."""

    def __post_init__(self) -> None:
        if not (self.duration_s >= 0 and self.assess_delay_s >= 0 and self.reroutes >= 0):
            raise ValueError(
                f"invalid execution plan: duration_s={self.duration_s}, assess_delay_s={self.assess_delay_s}, "
                f"reroutes={self.reroutes} (all must be >= 0)"
            )


# Outcome codes of the vectorized model (``terminations``).
COMPLETED, FAILED, HARNESS_TIMEOUT, HANG = 0, 1, 2, 3
_OUTCOME = {COMPLETED: "completed", FAILED: "failed", HARNESS_TIMEOUT: "harness_timeout"}


def terminations(
    c: WorkloadConfig,
    *,
    z_query: np.ndarray,
    u_hard: np.ndarray,
    u_prone: np.ndarray,
    z_exec: np.ndarray,
    u_exec: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The workload model on given random numbers: ``(termination_s, outcome_code, stall_s)``, each shaped like
    ``z_exec`` (queries x executions). ``z_query``/``u_hard``/``u_prone`` hold one value per query (shape (Q, 1)),
    ``u_exec`` three uniforms per execution (shape (Q, n, 3): failure, hang, stall point).

    Per query: difficulty ``query_median_s * exp(query_sigma * Z)``, times ``hard_query_factor`` for a share
    ``hard_query_rate``; per_query hangs: the query is hang-prone with ``hang_query_rate``. Per execution: a complete
    failure with ``failed_rate`` (ends at ``failed_at_s``); else a hang with ``hang_rate_in_query`` (per_execution: every
    query; per_query: prone queries only) that ends at the overall budget, or at its stall point plus
    ``stall_detect_s`` when ``exclusion_known = "stall"``; else ``difficulty * exp(exec_sigma * Z)``, cut at the
    harness timeout. A hang stalls at a uniform point of the run it would otherwise have had. Simulator and statistics
    share this function, so the fitted statistics are those of the executions the simulator runs."""
    difficulty = c.query_median_s * np.exp(c.query_sigma * z_query)
    difficulty = np.where(u_hard < c.hard_query_rate, difficulty * c.hard_query_factor, difficulty)
    natural = difficulty * np.exp(c.exec_sigma * z_exec)
    run = np.minimum(natural, c.harness_timeout_s)
    if c.exclusion == "per_execution":
        p_hang = np.full(u_prone.shape, c.hang_rate_in_query())
    else:
        p_hang = np.where(u_prone < c.hang_query_rate, c.hang_rate_in_query(), 0.0)
    failed = u_exec[..., 0] < c.failed_rate
    hang = ~failed & (u_exec[..., 1] < p_hang)
    stall = u_exec[..., 2] * run
    hang_end = (
        np.minimum(stall + c.stall_detect_s, c.overall_budget_s)
        if c.exclusion_known == "stall"
        else np.full(run.shape, c.overall_budget_s)
    )
    code = np.where(
        failed,
        FAILED,
        np.where(hang, HANG, np.where(natural >= c.harness_timeout_s, HARNESS_TIMEOUT, COMPLETED)),
    )
    end = np.where(failed, c.failed_at_s, np.where(hang, hang_end, run))
    return end, code, stall


class StatisticalWorkload:
    """The seeded workload model (``terminations``) plus evaluator latency (exponential per attempt) and failures
    retried within the overall budget. Random numbers come from streams keyed by (seed, group, stream) and are drawn
    row by row, so an execution's plan never depends on how many executions of its group were drawn."""

    def __init__(self, cfg: WorkloadConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self._cache: dict[int, list[ExecPlan]] = {}
        self._epochs: dict[int, np.ndarray] = {}

    def query_of(self, group_seq: int) -> int:
        """The query group ``group_seq`` runs: itself without a pool; with ``query_pool = Q``, entry ``seq % Q`` of
        epoch ``seq // Q``'s permutation of the pool (public, like a dataset index; its difficulty is not)."""
        Q = self.cfg.query_pool
        if not Q:
            return group_seq
        epoch = group_seq // Q
        perm = self._epochs.get(epoch)
        if perm is None:
            perm = self._epochs[epoch] = np.random.default_rng([self.seed, epoch, 7]).permutation(Q)
        return int(perm[group_seq % Q])

    def plan(self, group_seq: int, index: int) -> ExecPlan:
        plans = self._cache.get(group_seq)
        if plans is None or index >= len(plans):
            plans = self._cache[group_seq] = self._group(group_seq, max(index + 1, 32))
        return plans[index]

    def _group(self, group_seq: int, n: int) -> list[ExecPlan]:
        c = self.cfg

        def rng(stream: int) -> np.random.Generator:
            return np.random.default_rng([self.seed, group_seq, stream])

        def query_rng(stream: int) -> np.random.Generator:  # the query's own draws persist across its groups
            if not c.query_pool:
                return rng(stream)
            return np.random.default_rng([self.seed, self.query_of(group_seq), stream, 1])

        q = query_rng(0).random(3)
        z_query = np.array([[query_rng(1).standard_normal()]])
        end, code, stall = terminations(
            c,
            z_query=z_query,
            u_hard=q[None, 0:1],
            u_prone=q[None, 1:2],
            z_exec=rng(2).standard_normal(n)[None, :],
            u_exec=rng(3).random((n, 3))[None, :, :],
        )
        eval_u = rng(4).random((n, 16))
        eval_lat = (
            rng(5).exponential(c.eval_latency_s, (n, 16)) if c.eval_latency_s > 0 else np.zeros((n, 16))
        )
        hang_outcome: Outcome = "stalled" if c.exclusion_known == "stall" else "overall_timeout"
        out = []
        for i in range(n):
            duration, k = float(end[0, i]), int(code[0, i])
            if k == HANG:
                stall_at = float(stall[0, i]) if hang_outcome == "stalled" else None
                out.append(ExecPlan(duration, hang_outcome, 0.0, "excluded", stall_at_s=stall_at))
                continue
            outcome: Outcome = _OUTCOME[k]  # type: ignore[assignment]
            t, status = duration, None
            attempts: list[tuple[float, bool]] = []
            for a in range(16):  # retries against the same preserved state, within the overall budget
                t += float(eval_lat[i, a])
                attempts.append((float(eval_lat[i, a]), bool(eval_u[i, a] >= c.eval_failure_rate)))
                if t > c.overall_budget_s:
                    t, status = max(c.overall_budget_s, duration), "excluded"
                    break
                if attempts[-1][1]:
                    status = "no_work" if outcome == "failed" else "valid"
                    break
            evaluation = tuple(attempts) if outcome != "failed" else ()  # a placeholder is not evaluated
            out.append(ExecPlan(duration, outcome, t - duration, status or "excluded", evaluation=evaluation))
        return out


class TraceWorkload:
    """Replays a recorded trace: the n-th dispatched group takes the executions of the recorded group n (cycling).

    A recorded duration (launch to terminate) is a measurement and is replayed as is. It includes whatever its
    recorded reroutes cost, which the trace cannot separate out: the plan carries the number of recorded reroutes, and
    the simulator charges its ``reroute_penalty_s`` only for reroutes beyond those. Executions the recording
    cancelled or withdrew, or that were still running when it ended, have no observed duration; they take their
    group's longest observed duration (a lower bound for a straggler), documented in README."""

    def __init__(self, path: str | Path) -> None:
        groups: dict[str, list[str]] = {}
        launch: dict[str, float] = {}
        term: dict[str, tuple[float, str]] = {}
        assessed: dict[str, tuple[float, str]] = {}
        reroutes: dict[str, int] = {}
        for obj in iter_trace(path):
            ev = obj["ev"]
            if ev == "dispatch":  # a resumed run's carried group has a second line: one group
                groups.setdefault(obj["group"], []).extend(obj["executions"])
            elif ev == "launch":
                launch[obj["execution"]] = obj["t"]
            elif ev == "terminate":
                term[obj["execution"]] = (obj["t"], obj["outcome"])
            elif ev == "assessed":
                assessed[obj["execution"]] = (obj["t"], obj["status"])
            elif ev == "route":
                reroutes[obj["execution"]] = reroutes.get(obj["execution"], 0) + 1
        self.groups: list[list[ExecPlan]] = []
        for ids in groups.values():
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
                if outcome in ("overall_timeout", "stalled"):
                    plans.append(ExecPlan(t_end - launch[i], outcome, 0.0, "excluded", n))
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
