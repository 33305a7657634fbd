"""Calibrate the physical cost model (``CostConfig``) against real runs of ``gyre run`` and report the fit error.

``fit_costs(run_dirs) -> CostFit`` reads each run directory's ``trace.jsonl`` (claims, steps, switches, publications),
``metrics/steps.jsonl`` (trained target tokens, micro-steps and groups per step) and the model's size
(``model/model.safetensors`` header, else ``model/config.json``), then fits one cost model for all of them:

- training: every gap between two claims of one cell in one batch is one micro-step (unless the later claim's group
  became ready after the earlier claim: the cell may have waited for data); least squares
  ``t = overhead + s_per_token * tokens`` over those gaps, with the step's tokens per micro-step. The per-token slope
  gives ``node_train_tflops = 6 * params / s_per_token`` (a cell is one node here); the intercept is
  ``microstep_overhead_s``. A cell's first gap in a batch, less the fitted micro-step, is pipeline start-up (in
  micro-steps); ``step_end`` after the batch's last claim, less its micro-step, is the step's tail (drain + optimizer);
- warm-up: the first batch's extra wait for its first claim (model load, first kernels), one-off per run;
- switches and publication: mean durations (``transition_begin`` -> ``transition_end``, ``publish_begin`` ->
  ``publish``) less the weight-transfer term of the model's size at the model's default bandwidths; with one model size
  the size term and the fixed part cannot be told apart, so the fixed part takes everything the default bandwidth does
  not explain (stated in ``notes``).

The fit error is reported three ways: the micro-step model's relative RMS error over its samples; each cost's samples
against the fitted value; and every run replayed by the simulator with the fitted costs (its own recorded executions,
its own policy from the header) against the run's recorded time.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gyre_sched.config import CostConfig, SimConfig
from gyre_sched.replay import params_from_header, warmup_from_batches
from gyre_sched.sim import Simulator
from gyre_sched.trace import iter_trace

_DTYPE_BYTES = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "F64": 8,
    "float64": 8,
}


def model_size(run_dir: Path) -> tuple[int, float]:
    """(parameters, bytes per parameter) of the run's model: the safetensors header if present, else config.json."""
    st = run_dir / "model" / "model.safetensors"
    if st.exists():
        with st.open("rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        tensors = [v for k, v in header.items() if k != "__metadata__"]
        params = sum(math.prod(v["shape"]) for v in tensors)
        nbytes = sum(math.prod(v["shape"]) * _DTYPE_BYTES[v["dtype"]] for v in tensors)
        return params, nbytes / params
    cfg_path = run_dir / "model" / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{run_dir}: no model/model.safetensors or model/config.json to size the model from")
    c = json.loads(cfg_path.read_text())
    V, H, I, L = c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]  # noqa: E741
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim", H // heads)
    # q, o, k, v, MLP, 2 norms, q/k norms
    layer = H * heads * hd * 2 + H * kv * hd * 2 + 3 * H * I + 2 * H + 2 * hd
    params = V * H * (1 if c.get("tie_word_embeddings") else 2) + L * layer + H
    return params, float(_DTYPE_BYTES.get(str(c.get("dtype") or c.get("torch_dtype") or "bfloat16"), 2))


@dataclass
class RunData:
    path: Path
    lines: list[dict[str, Any]]
    steps: dict[int, dict[str, Any]]
    """metrics/steps.jsonl rows by the version they produced."""
    params: int
    weight_bytes: float


def read_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    lines = list(iter_trace(run_dir / "trace.jsonl"))
    steps = {}
    sj = run_dir / "metrics" / "steps.jsonl"
    if sj.exists():
        for raw in sj.read_text().splitlines():
            if raw.strip():
                row = json.loads(raw)
                steps[int(row["policy_version"])] = row
    params, wb = model_size(run_dir)
    return RunData(run_dir, lines, steps, params, wb)


@dataclass
class Sample:
    run: str
    value: float
    tokens: float = 0.0


@dataclass
class CostFit:
    cost: CostConfig
    """The fitted cost model (the runs' model size, tokens and this machine's constants)."""
    s_per_token: float
    s_per_token_se: float
    """Standard error of the per-token slope (least squares)."""
    overhead_s: float
    overhead_se: float
    microstep_rel_rmse: float
    """Relative RMS error of the fitted micro-step time over every micro-step sample."""
    costs: dict[str, dict[str, float]]
    """Per cost: fitted value, sample mean, relative RMS error of the samples against it, sample count."""
    runs: list[dict[str, Any]]
    """Per run: recorded and simulated total seconds with the fitted costs, relative error."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "s_per_token": self.s_per_token,
            "s_per_token_se": self.s_per_token_se,
            "microstep_overhead_s": self.overhead_s,
            "microstep_overhead_se": self.overhead_se,
            "microstep_rel_rmse": self.microstep_rel_rmse,
            "costs": self.costs,
            "runs": self.runs,
            "cost": self.cost.model_dump(exclude_none=True),
            "notes": self.notes,
        }


def _batches(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out, cur = [], None
    for x in lines:
        ev = x["ev"]
        if ev == "batch_open":
            cur = {"open": x["t"], "claims": [], "groups": [], "claim_groups": []}
        elif cur is not None and ev == "group_assign":
            cur["groups"].append(x["group"])
        elif cur is not None and ev == "microstep_claim" and x.get("kind", "train") == "train":
            cur["claims"].append((x["t"], int(x["cell"])))
            cur["claim_groups"].append(x.get("group"))
        elif cur is not None and ev == "step_end":
            cur["end"], cur["version"] = x["t"], int(x["version"])
            cur["groups"] = cur["groups"] or list(x["groups"])
            out.append(cur)
            cur = None
    return out


def _rel_rmse(samples: list[float], value: float) -> float:
    if not samples or value <= 0:
        return 0.0
    return math.sqrt(sum(((s - value) / value) ** 2 for s in samples) / len(samples))


def fit_costs(run_dirs: list[str | Path], *, simulate: bool = True) -> CostFit:
    runs = [read_run(d) for d in run_dirs]
    if not runs:
        raise ValueError("no run directories")
    sizes = {(r.params, r.weight_bytes) for r in runs}
    if len(sizes) > 1:
        raise ValueError(f"runs of different models cannot share one calibration: {sorted(sizes)}")
    params, wbytes = runs[0].params, runs[0].weight_bytes
    notes: list[str] = []
    # ---- micro-steps: gaps between one cell's claims in one batch ----
    gaps: list[Sample] = []
    firsts: list[Sample] = []
    tails: list[Sample] = []
    tok_group: list[float] = []
    tok_ms: list[float] = []
    warm: list[float] = []
    run_tokens: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in runs:
        batches = _batches(r.lines)
        ready_at = {x["group"]: x["t"] for x in r.lines if x["ev"] == "group_ready"}
        w = warmup_from_batches(batches, ready_at)
        if w is not None:
            warm.append(w)
        for b in batches:
            row = r.steps.get(b["version"])
            if row is None or not b["claims"]:
                continue
            tokens = row["num_target_tokens"] / max(1, row["num_microsteps"])
            tok_ms.append(tokens)
            tok_group.append(row["num_target_tokens"] / max(1, row["num_groups"]))
            run_tokens[r.path.name][0].append(tok_group[-1])
            run_tokens[r.path.name][1].append(tokens)
            by_cell: dict[int, list[tuple[float, float]]] = defaultdict(list)
            for (t, cell), g in zip(b["claims"], b["claim_groups"], strict=True):
                by_cell[cell].append((t, ready_at.get(g, -math.inf)))
            for ts in by_cell.values():
                ts.sort()
                for i, ((t0, _), (t1, ready)) in enumerate(itertools.pairwise(ts)):
                    # its group became ready after the cell's last claim: the gap may hold a wait
                    if ready > t0:
                        continue
                    (gaps if i else firsts).append(Sample(r.path.name, t1 - t0, tokens))
            tails.append(Sample(r.path.name, b["end"] - max(b["claims"])[0], tokens))
    if len(gaps) < 3:
        raise ValueError("too few micro-step samples (claims of one cell in one batch) to fit training time")
    X = np.array([[1.0, s.tokens] for s in gaps])
    y = np.array([s.value for s in gaps])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    dof = max(1, len(y) - 2)
    sigma2 = float(resid @ resid) / dof
    cov = sigma2 * np.linalg.pinv(X.T @ X)
    overhead, slope = float(coef[0]), float(coef[1])
    overhead_se, slope_se = math.sqrt(max(cov[0, 0], 0.0)), math.sqrt(max(cov[1, 1], 0.0))
    if overhead < 0 and slope > 0:  # a negative fixed part is unphysical: fit through the origin instead
        slope, overhead = float(X[:, 1] @ y / (X[:, 1] @ X[:, 1])), 0.0
        notes.append(
            f"least-squares intercept was negative ({float(coef[0]):.3g} s): refitted through the origin"
        )
    if slope <= 0 or slope < 2 * slope_se:
        notes.append(
            f"per-token slope {slope:.3g} +- {slope_se:.2g} s/token is not significant: tokens per micro-step vary "
            f"only {min(s.tokens for s in gaps):.0f}-{max(s.tokens for s in gaps):.0f} in these runs; the micro-step "
            "time is taken as per-token at the mean tokens (intercept 0)"
        )
        mean_tok = statistics.fmean(s.tokens for s in gaps)
        slope, overhead = statistics.fmean(y) / mean_tok, 0.0
    pred = np.array([overhead + slope * s.tokens for s in gaps])
    ms_rmse = float(np.sqrt(np.mean(((y - pred) / pred) ** 2)))

    def ms_time(tokens: float) -> float:
        return overhead + slope * tokens

    startup = [max(0.0, s.value - ms_time(s.tokens)) for s in firsts]
    compute_ms = statistics.fmean(slope * t for t in tok_ms)
    tail = [max(0.0, s.value - ms_time(s.tokens)) for s in tails]
    # ---- switches and publication ----
    up0, up_sat, down, pub = [], [], [], []
    for r in runs:
        begin: dict[int, tuple[float, str]] = {}
        pub_begin: dict[int, float] = {}
        for x in r.lines:
            if x["ev"] == "transition_begin":
                begin[int(x["cell"])] = (x["t"], x["to"])
            elif x["ev"] == "transition_end" and int(x["cell"]) in begin:
                t0, to = begin.pop(int(x["cell"]))
                if to == "to_training":
                    (up0 if int(x["cell"]) == 0 else up_sat).append(x["t"] - t0)
                else:
                    down.append(x["t"] - t0)
            elif x["ev"] == "publish_begin":
                pub_begin[int(x["version"])] = x["t"]
            elif x["ev"] == "publish" and int(x["version"]) in pub_begin:
                pub.append(x["t"] - pub_begin.pop(int(x["version"])))
    base = CostConfig()
    gb = params * wbytes / 1e9
    host, net = gb / base.host_gbps, gb / base.network_gbps
    notes.append(
        f"one model size ({params} parameters, {gb * 1e3:.3f} MB): the weight-transfer terms at the default bandwidths "
        f"({host * 1e3:.3f} ms host, {net * 1e3:.3f} ms network) cannot be separated from the fixed parts"
    )

    def mean(xs: list[float], default: float = 0.0) -> float:
        return statistics.fmean(xs) if xs else default

    up = mean(up0, mean(up_sat))
    join = max(0.0, mean(up_sat, up) - up)
    tokens_exec = mean(tok_group) / _N(runs)
    cost = CostConfig(
        model_params_b=params / 1e9,
        weight_bytes=wbytes,
        tokens_per_execution=tokens_exec,
        microstep_tokens=mean(tok_ms),
        node_train_tflops=6 * params / slope / 1e12,
        train_scaling=1.0,
        microstep_overhead_s=max(0.0, overhead),
        pipeline_startup_microsteps=mean(startup) / compute_ms,
        pipeline_drain_microsteps=0.0,
        optimizer_fixed_s=max(0.0, mean(tail) - net),
        switch_to_training_fixed_s=max(0.0, up - host),
        switch_to_rollout_fixed_s=max(0.0, mean(down) - host),
        publish_fixed_s=max(0.0, mean(pub) - net),
        reroute_context_tokens=0.0,
        satellite_join_s=join,
        warmup_s=mean(warm),
    )
    resolved = cost.resolve(nodes_per_cell=1, N=_N(runs))
    costs = {
        "microstep_s": {
            "fitted": resolved.microstep_s,
            "mean": mean([s.value for s in gaps]),
            "rel_rmse": ms_rmse,
            "samples": len(gaps),
        },
        "pipeline_startup_s": {
            "fitted": resolved.pipeline_startup_s,
            "mean": mean(startup),
            "rel_rmse": _rel_rmse(startup, resolved.pipeline_startup_s),
            "samples": len(startup),
        },
        "step_tail_s": {
            "fitted": resolved.optimizer_s,
            "mean": mean(tail),
            "rel_rmse": _rel_rmse(tail, resolved.optimizer_s),
            "samples": len(tail),
        },
        "switch_to_training_s": {
            "fitted": resolved.switch_to_training_s,
            "mean": up,
            "rel_rmse": _rel_rmse(up0 or up_sat, resolved.switch_to_training_s),
            "samples": len(up0 or up_sat),
        },
        "satellite_join_s": {
            "fitted": resolved.satellite_join_s,
            "mean": join,
            "rel_rmse": 0.0,
            "samples": len(up_sat),
        },
        "switch_to_rollout_s": {
            "fitted": resolved.switch_to_rollout_s,
            "mean": mean(down),
            "rel_rmse": _rel_rmse(down, resolved.switch_to_rollout_s),
            "samples": len(down),
        },
        "publish_s": {
            "fitted": resolved.publish_s,
            "mean": mean(pub),
            "rel_rmse": _rel_rmse(pub, resolved.publish_s),
            "samples": len(pub),
        },
        "warmup_s": {
            "fitted": resolved.warmup_s,
            "mean": mean(warm),
            "rel_rmse": _rel_rmse(warm, resolved.warmup_s),
            "samples": len(warm),
        },
    }
    fit = CostFit(cost, slope, slope_se, overhead, overhead_se, ms_rmse, costs, [], notes)
    if simulate:
        N = _N(runs)
        for r in runs:  # each run replays with its own tokens (a property of its data, not of the machine)
            per_group, per_ms = run_tokens[r.path.name]
            own = (
                {"tokens_per_execution": mean(per_group) / N, "microstep_tokens": mean(per_ms)}
                if per_ms
                else {}
            )
            fit.runs.append(replay_run(r, cost.model_copy(update=own)))
    return fit


def _N(runs: list[RunData]) -> int:
    ns = {int(r.lines[0]["N"]) for r in runs}
    if len(ns) != 1:
        raise ValueError(f"runs with different N: {sorted(ns)}")
    return ns.pop()


def replay_run(run: RunData, cost: CostConfig) -> dict[str, Any]:
    """Simulate a recorded run (its executions, its policy from the header) with ``cost``; compare total times."""
    header = run.lines[0]
    params, _ = params_from_header(header)
    ends = [x["t"] for x in run.lines if x["ev"] == "step_end"]
    if not ends:
        raise ValueError(f"{run.path}: no step_end to compare with")
    raw = {
        "name": f"costfit-{run.path.name}",
        "steps": len(ends),
        "warmup_bursts": 0,
        "policy": {
            k: getattr(params, k)
            for k in (
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
            )
        },
        "cluster": {"nodes": params.K, "nodes_per_cell": 1, "slots_per_node": params.C_e, "C_s": params.C_s},
        "workload": {
            "trace": str(run.path / "trace.jsonl"),
            "harness_timeout_s": params.harness_timeout_s,
            "overall_budget_s": params.overall_budget_s,
        },
        "cost": cost.model_dump(),
    }
    res = Simulator(SimConfig.model_validate(raw)).run()
    recorded = ends[-1]
    return {
        "run": run.path.name,
        "policy": params.kind,
        "steps": len(ends),
        "recorded_s": recorded,
        "simulated_s": res.end_time_s,
        "relative_error": abs(res.end_time_s - recorded) / recorded,
    }
