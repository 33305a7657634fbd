"""Predict a recorded run's wall time from its own trace: calibrate the simulator's cost model from the trace's
measured costs, replay its executions, run the same policy (parameters from the trace header) on a simulated clock.

``predict(trace_path) -> Prediction``; CLI: ``gyre-sched predict TRACE`` (one JSON line).

What is measured, from which events (every cost the trace has no sample of is 0 and listed in ``unmeasured``):

- executions: duration launch -> terminate, evaluation terminate -> assessed, outcome and status, per execution
  (replayed as recorded by ``TraceWorkload``, reroute costs included);
- training: ``batch_open`` / ``microstep_claim`` / ``step_end``. The gap between two claims of one cell in one batch is
  a micro-step (the median of those after a cell's first claim of a batch); a cell's first gap minus that is the
  pipeline start-up; ``step_end`` minus the batch's last claim, less its micro-step, is the drain + optimizer tail
  (+ broadcast, separated when both non-final multi-cell steps and other steps exist). Micro-steps per group =
  claims / groups (rounded for the simulator, the work per group kept exact). When no cell claims twice in a batch, the claims carry no duration: each batch's span (from
  ``batch_open``, or the readiness of its last group if later, to ``step_end``) is taken as one cell training its
  groups back to back (cell-seconds per group = span / groups, no start-up or tail);
- switches: ``transition_begin`` -> ``transition_end`` per cell: cell 0 to training = ``switch_to_training_s``,
  satellites' excess over it = ``satellite_join_s``; to rollout = ``switch_to_rollout_s``;
- publication: ``publish_begin`` -> ``publish`` of the same version;
- a one-off warm-up (model load, first kernels): how much longer the first batch waited for its first claim than the
  median later batch (real claims only).

Not measurable from a trace (0 in the prediction): cancel latency (a cancel is not traced), the reroute penalty
(already inside the recorded durations).
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import fields
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from gyre_sched.config import PolicyParams, SimConfig, WorkloadConfig
from gyre_sched.sim import Simulator
from gyre_sched.trace import iter_trace

__all__ = ["Measured", "Prediction", "calibrate", "params_from_header", "predict"]

_PARAM_FIELDS = tuple(f.name for f in fields(PolicyParams))
_POLICY_CONFIG_FIELDS = (
    "kind",
    "N",
    "B",
    "phi",
    "mu",
    "rho_min",
    "tau_s",
    "k_spare",
    "streaming",
    "dispatch",
    "q_c",
    "async_train_cells",
    "spares",
    "planner",
    "target_staleness",
    "mu_max",
)
_MEASURABLE = (
    "switch_to_training_s",
    "satellite_join_s",
    "switch_to_rollout_s",
    "publish_s",
    "pipeline_startup_s",
    "optimizer_s",
    "broadcast_s",
)


class Measured(BaseModel):
    """One cost as calibrated from the trace."""

    model_config = ConfigDict(frozen=True)
    value: float
    samples: int
    source: str
    """The trace events it was measured from (and how)."""


class Prediction(BaseModel):
    """The simulator's prediction of a recorded run, next to what the trace itself says."""

    model_config = ConfigDict(frozen=True)
    trace: str
    policy: str
    steps: int
    step_s: list[float]
    """Predicted wall seconds of each step (from the previous step's end; the first from t = 0)."""
    total_s: float
    """Predicted wall seconds to the last step's end."""
    recorded_step_s: list[float]
    recorded_total_s: float
    """The trace's own time of its last step_end."""
    relative_error: float
    """|total_s - recorded_total_s| / recorded_total_s."""
    params: dict[str, Any]
    """The policy parameters the simulator ran (from the trace header, then overrides)."""
    assumed_params: list[str]
    """Policy parameters neither in the header nor overridden: PolicyParams defaults were used."""
    measured: dict[str, Measured]
    """Each cost calibrated from the trace: value, samples, source events."""
    unmeasured: list[str]
    """Costs the trace has no sample of (0 in the simulation)."""
    executions: int
    """Executions with a recorded launch and terminate (replayed with their recorded durations)."""
    sim_config: dict[str, Any]


def params_from_header(
    header: dict[str, Any], overrides: dict[str, Any] | None = None
) -> tuple[PolicyParams, list[str]]:
    """The policy parameters a trace header records (``policy`` is the kind; ``k_spare`` may come as ``N_d``),
    then ``overrides``; returns them with the names that fell back to PolicyParams defaults."""
    got: dict[str, Any] = {k: header[k] for k in _PARAM_FIELDS if k in header}
    if "policy" in header:
        got["kind"] = header["policy"]
    if "k_spare" not in got and "N_d" in header and "N" in header:
        got["k_spare"] = int(header["N_d"]) - int(header["N"])
    unknown = sorted(set(overrides or {}) - set(_PARAM_FIELDS))
    if unknown:
        raise ValueError(f"unknown policy parameter(s) {unknown}; known: {list(_PARAM_FIELDS)}")
    got.update(overrides or {})
    assumed = [k for k in _PARAM_FIELDS if k not in got]
    return PolicyParams(**got), assumed


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def warmup_from_batches(batches: list[dict[str, Any]], ready_at: dict[str, float]) -> float | None:
    """The run's one-off warm-up: how much longer its first batch waited for its first claim (from the batch's open,
    or its first group's readiness if later) than the median later batch; None without two batches with claims."""
    delays = []
    for b in batches:
        if not b["claims"]:
            continue
        ready = [ready_at[g] for g in b["groups"] if g in ready_at]
        start = max(b["open"], min(ready)) if ready else b["open"]
        delays.append(max(0.0, min(t for t, _ in b["claims"]) - start))
    if len(delays) < 2:
        return None
    return max(0.0, delays[0] - statistics.median(delays[1:]))


def calibrate(lines: list[dict[str, Any]]) -> tuple[dict[str, Measured], list[str], dict[str, float]]:
    """Measured costs from trace lines: (measured, unmeasured names, the [cost] table for SimConfig)."""
    measured: dict[str, Measured] = {}
    # ---- switches and publication ----
    begin: dict[int, tuple[float, str]] = {}
    core_up, sat_up, down = [], [], []
    pub_begin: dict[int, float] = {}
    pubs = []
    for x in lines:
        ev = x["ev"]
        if ev == "transition_begin":
            begin[int(x["cell"])] = (x["t"], x["to"])
        elif ev == "transition_end" and int(x["cell"]) in begin:
            t0, to = begin.pop(int(x["cell"]))
            if to == "to_training":
                (core_up if int(x["cell"]) == 0 else sat_up).append(x["t"] - t0)
            else:
                down.append(x["t"] - t0)
        elif ev == "publish_begin":
            pub_begin[int(x["version"])] = x["t"]
        elif ev == "publish" and int(x["version"]) in pub_begin:
            pubs.append(x["t"] - pub_begin.pop(int(x["version"])))
    src = "transition_begin -> transition_end"
    if core_up:
        measured["switch_to_training_s"] = Measured(
            value=_mean(core_up), samples=len(core_up), source=f"{src}, cell 0 to training (mean)"
        )
        if sat_up:
            measured["satellite_join_s"] = Measured(
                value=max(0.0, _mean(sat_up) - _mean(core_up)),
                samples=len(sat_up),
                source=f"{src}, satellites to training, mean excess over cell 0",
            )
    elif sat_up:
        measured["switch_to_training_s"] = Measured(
            value=_mean(sat_up), samples=len(sat_up), source=f"{src}, satellites to training (mean)"
        )
    if down:
        measured["switch_to_rollout_s"] = Measured(
            value=_mean(down), samples=len(down), source=f"{src}, to rollout (mean)"
        )
    if pubs:
        measured["publish_s"] = Measured(
            value=_mean(pubs), samples=len(pubs), source="publish_begin -> publish, same version (mean)"
        )

    # ---- training ----
    ready_at: dict[str, float] = {}
    batches: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for x in lines:
        ev = x["ev"]
        if ev == "group_ready":
            ready_at[x["group"]] = x["t"]
        elif ev == "batch_open":
            cur = {"open": x["t"], "claims": [], "groups": []}
        elif cur is not None and ev == "group_assign":
            cur["groups"].append(x["group"])
        elif cur is not None and ev == "microstep_claim":
            cur["claims"].append((x["t"], int(x["cell"])))
        elif cur is not None and ev == "step_end":
            cur["end"], cur["version"] = x["t"], int(x["version"])
            cur["n_groups"] = len(x["groups"])
            cur["groups"] = cur["groups"] or list(x["groups"])
            batches.append(cur)
            cur = None
    firsts, rests, tails = [], [], []
    claims_total = groups_total = 0
    per_cell_batches: list[dict[int, list[float]]] = []
    for b in batches:
        by_cell: dict[int, list[float]] = defaultdict(list)
        for t, cell in b["claims"]:
            by_cell[cell].append(t)
        per_cell_batches.append(by_cell)
        for ts in by_cell.values():
            gaps = [t1 - t0 for t0, t1 in itertools.pairwise(ts)]
            if gaps:
                firsts.append(gaps[0])
                rests += gaps[1:]
        claims_total += len(b["claims"])
        groups_total += b["n_groups"]
    cost: dict[str, float] = {}
    if rests or firsts:  # real claims: durations from the gaps between a cell's claims
        ms = statistics.median(rests) if rests else statistics.median(firsts)
        startup = max(0.0, statistics.median(firsts) - ms) if rests and firsts else 0.0
        per_group = claims_total / max(1, groups_total)
        mu = int(lines[0].get("mu", 1)) if lines and lines[0].get("ev") == "header" else 1
        for b, by_cell in zip(batches, per_cell_batches, strict=True):
            if not b["claims"]:
                continue
            t_last, cell = max(b["claims"])
            first_of_cell = len(by_cell[cell]) == 1
            tail = b["end"] - t_last - ms - (startup if first_of_cell else 0.0)
            broadcast = len(by_cell) > 1 and b["version"] % mu != 0  # a non-final step with satellites
            tails.append((max(0.0, tail), broadcast))
        n = len(rests) or len(firsts)
        measured["train_s_per_microstep"] = Measured(
            value=ms, samples=n, source="microstep_claim gaps of one cell in one batch (median)"
        )
        measured["microsteps_per_group"] = Measured(
            value=per_group, samples=groups_total, source="microstep_claim count / step_end groups"
        )
        if rests and firsts:
            measured["pipeline_startup_s"] = Measured(
                value=startup,
                samples=len(firsts),
                source="a cell's first claim gap of a batch minus the micro-step",
            )
        if tails:
            multi = [t for t, m in tails if m]
            single = [t for t, m in tails if not m]
            if multi and single and _mean(multi) > _mean(single):
                measured["broadcast_s"] = Measured(
                    value=_mean(multi) - _mean(single),
                    samples=len(multi),
                    source="step_end tail of non-final multi-cell steps minus that of the others (mean)",
                )
                tail_v = _mean(single)
            else:
                tail_v = _mean([t for t, _ in tails])
            measured["optimizer_s"] = Measured(
                value=tail_v,
                samples=len(tails),
                source="step_end minus the batch's last claim, less its micro-step (drain + optimizer, mean)",
            )
        cost["microsteps_per_group"] = max(1, round(per_group))
        cost["train_node_s_per_group"] = ms * per_group  # the work per group, whatever the rounding above
        warm = warmup_from_batches(batches, ready_at)
        if warm is not None:
            measured["warmup_s"] = Measured(
                value=warm,
                samples=1,
                source="first batch's wait for its first claim minus the median later batch's (one-off warm-up)",
            )
            cost["warmup_s"] = warm
    elif batches:  # claims without durations: one cell trained each batch's groups back to back
        spans, n_groups = [], 0
        for b in batches:
            start = max([b["open"], *(ready_at[g] for g in b["groups"] if g in ready_at)])
            spans.append(max(0.0, b["end"] - start))
            n_groups += b["n_groups"]
        per_group = sum(spans) / max(1, n_groups)
        measured["train_s_per_group"] = Measured(
            value=per_group,
            samples=len(spans),
            source="batch_open (or its last group_ready) -> step_end span / groups: no cell claims twice in a batch",
        )
        cost["microsteps_per_group"] = 1
        cost["train_node_s_per_group"] = per_group
    for name in _MEASURABLE:
        if name in measured:
            cost[name] = measured[name].value
    unmeasured = [n for n in (*_MEASURABLE, "cancel_latency_s", "reroute_penalty_s") if n not in cost]
    if "train_node_s_per_group" not in cost:
        unmeasured.insert(0, "train_node_s_per_group")
    cost["train_node_s_per_group"] = max(cost.get("train_node_s_per_group", 0.0), 1e-9)
    for name in unmeasured:
        cost.setdefault(name, 0.0)
    cost["pipeline_drain_s"] = 0.0  # measured together with the optimizer as the step's tail
    cost["train_scaling"] = 1.0
    return measured, unmeasured, cost


def predict(
    trace_path: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    workload: WorkloadConfig | None = None,
    seed: int = 0,
) -> Prediction:
    """Calibrate the cost model from a recorded trace, replay its executions under the same policy parameters (trace
    header, then ``overrides``), and compare the simulated wall time with the trace's own.

    ``workload``: run the workload definition the recording played (`gyre_sched.workload_harness`, with ``seed``)
    instead of replaying the recorded executions: a prediction of the workload, not of one recording of it."""
    path = Path(trace_path)
    lines = list(iter_trace(path))
    if not lines or lines[0]["ev"] != "header":
        raise ValueError(f"{path}: a trace starts with its header line")
    params, assumed = params_from_header(lines[0], overrides)
    step_ends = [x["t"] for x in lines if x["ev"] == "step_end"]
    if not step_ends:
        raise ValueError(f"{path}: no step_end: the recording finished no optimizer step to predict")
    measured, unmeasured, cost = calibrate(lines)
    cancel_latency = cost.pop("cancel_latency_s")
    raw = {
        "name": f"predict-{path.stem}",
        "steps": len(step_ends),
        "warmup_bursts": 0,
        "policy": {k: getattr(params, k) for k in _POLICY_CONFIG_FIELDS},
        "cluster": {"nodes": params.K, "nodes_per_cell": 1, "slots_per_node": params.C_e, "C_s": params.C_s},
        "seed": seed,
        "workload": (
            {
                "trace": str(path),
                "harness_timeout_s": params.harness_timeout_s,
                "overall_budget_s": params.overall_budget_s,
            }
            if workload is None
            else workload.model_dump()
        )
        | {"cancel_latency_s": cancel_latency},
        "cost": cost,
    }
    cfg = SimConfig.model_validate(raw)
    res = Simulator(cfg).run()
    pred = res.step_end_s

    def deltas(ts: list[float]) -> list[float]:
        return [round(b - a, 6) for a, b in zip([0.0, *ts], ts, strict=False)]

    recorded = step_ends[-1]
    return Prediction(
        trace=str(path),
        policy=params.kind,
        steps=len(step_ends),
        step_s=deltas(pred),
        total_s=round(res.end_time_s, 6),
        recorded_step_s=deltas(step_ends),
        recorded_total_s=recorded,
        relative_error=abs(res.end_time_s - recorded) / recorded if recorded > 0 else 0.0,
        params={k: getattr(params, k) for k in _PARAM_FIELDS},
        assumed_params=assumed,
        measured=measured,
        unmeasured=unmeasured,
        executions=sum(1 for x in lines if x["ev"] == "terminate"),
        sim_config=cfg.model_dump(),
    )
