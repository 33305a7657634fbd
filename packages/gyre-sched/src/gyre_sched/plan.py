"""`gyre-sched plan`: sweep the scheduling knobs for a cluster and a workload (preset or recorded trace) and recommend
settings, each with its simulated end-to-end time and realized staleness.

For each target staleness E it simulates, on the same executions (same seed or the same recorded trace):

- Elastic at every (phi, mu) with phi + (mu - 1)/2 = E (eq. 2; phi * B whole), with the configured spares and without,
  spares eager and idle;
- the adaptive planner holding E (``planner = "adaptive"``, mu from each fixed setting above that is feasible);
- Async at mu = 1, phi = E for every split of training cells, and Colocate at phi = 0, mu = 2E + 1 when that is whole;
- for the recommended setting (``gyre_sched.bound``): the ideal bound, the capacity bound (no schedule of these
  executions on this cluster ends earlier), and the dispatch-order reference (free training, every slot rolling out,
  launches in dispatch order): what a schedule that does not know the durations reaches without any training cost,
  so ``over_dispatch_order`` is the recommendation's own overhead and the rest of ``over_bound`` is launch order.

The recommendation is the fastest run whose realized staleness (every consumed group, refills and warm-up included)
stays within ``tolerance`` of E. A plot shows time against realized staleness for every run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gyre_sched.bound import capacity_bound, dispatch_order_reference
from gyre_sched.config import SimConfig
from gyre_sched.presets import deep_merge
from gyre_sched.sim import Simulator


@dataclass
class PlanRow:
    target: float
    kind: str
    phi: float
    mu: int
    k_spare: int
    spares: str
    planner: str
    async_train_cells: int | None
    time_h: float
    staleness: float
    """Realized mean staleness over every consumed group."""
    staleness_steady: float
    """Warm-up bursts and refills aside (as eq. 2 is stated)."""
    dropped_groups: int

    @property
    def label(self) -> str:
        if self.kind == "async":
            return f"async {self.async_train_cells} train cells"
        if self.kind == "colocate":
            return f"colocate mu={self.mu}"
        head = "adaptive" if self.planner == "adaptive" else f"phi={self.phi:g}"
        return f"elastic {head} mu={self.mu} k={self.k_spare} {self.spares}"


def candidates(cfg: SimConfig, target: float) -> list[dict[str, Any]]:
    """Policy overrides to simulate at ``target`` (see module docstring)."""
    p = cfg.policy
    B, K = p.B, cfg.cluster.K
    out: list[dict[str, Any]] = []
    spares = sorted({0, p.k_spare})
    for mu in range(1, int(2 * target + 1 + 1e-9) + 1):
        phi = target - (mu - 1) / 2
        if phi < -1e-9 or abs(phi * B - round(phi * B)) > 1e-9:
            continue
        for k in spares:
            for mode in ("eager", "idle") if k else ("eager",):
                out.append({"kind": "elastic", "phi": max(phi, 0.0), "mu": mu, "k_spare": k, "spares": mode})
        out.append(
            {
                "kind": "elastic",
                "phi": max(phi, 0.0),
                "mu": mu,
                "k_spare": p.k_spare,
                "spares": p.spares,
                "planner": "adaptive",
                "target_staleness": target,
            }
        )
    if abs(target * B - round(target * B)) < 1e-9:
        for a in range(1, K):
            out.append({"kind": "async", "phi": target, "mu": 1, "async_train_cells": a})
    mu_c = 2 * target + 1
    if abs(mu_c - round(mu_c)) < 1e-9:
        out.append({"kind": "colocate", "phi": 0.0, "mu": round(mu_c)})
    return out


def run_candidate(cfg: SimConfig, policy: dict[str, Any], target: float) -> PlanRow:
    c = SimConfig.model_validate(deep_merge(cfg.model_dump(), {"policy": policy}))
    r = Simulator(c).run()
    q = c.policy
    return PlanRow(
        target=target,
        kind=q.kind,
        phi=q.phi,
        mu=q.mu,
        k_spare=q.k_spare,
        spares=q.spares,
        planner=q.planner,
        async_train_cells=q.async_train_cells if q.kind == "async" else None,
        time_h=r.end_time_s / 3600,
        staleness=r.mean_staleness,
        staleness_steady=r.mean_staleness_steady,
        dropped_groups=r.counters["dropped_groups"],
    )


def recommend(rows: list[PlanRow], target: float, tolerance: float = 0.05) -> PlanRow | None:
    ok = [r for r in rows if r.target == target and r.staleness <= target + tolerance]
    return min(ok, key=lambda r: r.time_h) if ok else None


def plan(
    cfg: SimConfig,
    targets: list[float],
    *,
    tolerance: float = 0.05,
    out: Path | None = None,
    log: Any = None,
) -> dict[str, Any]:
    """Sweep every target; with ``out``: plan.json and plan.png there. Returns the JSON-able summary."""
    rows: list[PlanRow] = []
    best: dict[float, dict[str, Any]] = {}
    for target in targets:
        for policy in candidates(cfg, target):
            row = run_candidate(cfg, policy, target)
            rows.append(row)
            if log:
                log(f"E[d]={target:<4} {row.label:<40} {row.time_h:8.2f} h  staleness {row.staleness:.3f}")
        rec = recommend(rows, target, tolerance)
        if rec is None:
            continue
        pol = {k: getattr(rec, k) for k in ("kind", "phi", "mu", "k_spare", "spares", "planner")}
        if rec.planner == "adaptive":
            pol["target_staleness"] = target
        if rec.async_train_cells is not None:
            pol["async_train_cells"] = rec.async_train_cells
        rec_cfg = SimConfig.model_validate(deep_merge(cfg.model_dump(), {"policy": pol}))
        cap = capacity_bound(rec_cfg)
        bound, dispatch = cap.ideal_s / 3600, dispatch_order_reference(rec_cfg).end_time_s / 3600
        best[target] = {
            "recommended": asdict(rec),
            "label": rec.label,
            "bound_h": bound,
            "over_bound": rec.time_h / bound,
            "capacity_bound_h": cap.end_time_s / 3600,
            "over_capacity_bound": rec.time_h * 3600 / cap.end_time_s,
            "dispatch_order_h": dispatch,
            "over_dispatch_order": rec.time_h / dispatch,
        }
    summary = {
        "config": cfg.name,
        "steps": cfg.steps,
        "tolerance": tolerance,
        "best": best,
        "runs": [asdict(r) for r in rows],
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(summary, indent=2))
        from gyre_sched.plots import plan_png

        plan_png(rows, best, out / "plan.png", f"{cfg.name}: {cfg.steps} steps")
    return summary
