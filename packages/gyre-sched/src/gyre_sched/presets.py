"""Presets (the paper's NL2RepoBench setting) and matched-staleness settings for `compare` (eq. 2)."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gyre_sched.config import PolicyKind, SimConfig

# DESIGN §9, NL2RepoBench on Qwen 3.6 122B: 32 nodes = 8 cells x 4 nodes, 144 executions per cell, N=16, B=32,
# Gyre mu=3 phi=0.5 at E[d]=1.5. Workload parameters were fitted (README) to: mean 1.93 h per execution, 2.96 h per
# query (its longest execution), 9.51% of queries >= 4 h, 6.25% harness timeouts, 0.87% overall timeouts.
NL2REPO: dict[str, Any] = {
    "name": "nl2repo-122b",
    "steps": 48,
    "seed": 0,
    "warmup_bursts": 1,
    "policy": {
        "kind": "elastic", "N": 16, "B": 32, "phi": 0.5, "mu": 3, "rho_min": 0.5, "tau_s": 60.0,
        "k_spare": 1, "streaming": True, "async_train_cells": 2,
    },
    "cluster": {"nodes": 32, "nodes_per_cell": 4, "slots_per_node": 36, "standalone_nodes": 0},
    "workload": {
        "query_median_s": 6000.0, "query_sigma": 0.1, "exec_sigma": 0.3,
        "hard_query_rate": 0.06, "hard_query_factor": 4.0,
        "harness_timeout_s": 4 * 3600.0, "overall_budget_s": 5 * 3600.0,
        "failed_rate": 0.002, "overall_timeout_rate": 0.0087,
        "eval_latency_s": 300.0, "eval_failure_rate": 0.05,
    },
    "cost": {
        "train_node_s_per_group": 1440.0, "train_scaling": 1.0, "microsteps_per_group": 4,
        "pipeline_startup_s": 60.0, "pipeline_drain_s": 60.0, "optimizer_s": 30.0, "broadcast_s": 20.0,
        "switch_to_training_s": 8.52, "switch_to_rollout_s": 3.46, "satellite_join_s": 30.0,
        "publish_s": 60.0, "reroute_penalty_s": 20.0,
    },
}  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {"nl2repo": NL2REPO}


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = (
            deep_merge(out[k], v)
            if isinstance(v, dict) and isinstance(out.get(k), dict)
            else copy.deepcopy(v)
        )
    return out


def resolve(raw: dict[str, Any]) -> dict[str, Any]:
    """Apply ``preset = NAME`` (the file's own keys override the preset's)."""
    raw = dict(raw)
    name = raw.pop("preset", None)
    if name is None:
        return raw
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return deep_merge(PRESETS[name], raw)


class CompareConfig(BaseModel):
    """The [compare] table: which policies, at which matched staleness, with which per-policy knobs."""

    model_config = ConfigDict(extra="forbid")
    policies: list[PolicyKind] = ["elastic", "async", "colocate"]
    staleness: float | None = Field(1.5, ge=0)
    """Target E[d]; None keeps each policy's phi/mu from its overrides."""
    mu: dict[str, int] = {"elastic": 3, "async": 1}
    """mu per policy (phi follows from eq. 2); Colocate's mu follows from its phi."""
    colocate_phi: float = Field(0.0, ge=0)
    """Colocate's extra dispatch (> 0 needs a standalone pool)."""
    overrides: dict[str, dict[str, Any]] = {}
    """Per-policy config overrides, e.g. {"colocate": {"cluster": {"standalone_nodes": 4}}}."""


def matched(kind: PolicyKind, target: float, cmp: CompareConfig) -> tuple[float, int]:
    """(phi, mu) giving E[d] = phi + (mu - 1)/2 = target (eq. 2)."""
    if kind == "colocate":
        mu2 = 2 * (target - cmp.colocate_phi) + 1
        if mu2 < 1 or abs(mu2 - round(mu2)) > 1e-9:
            raise ValueError(
                f"colocate: E[d]={target} with phi={cmp.colocate_phi} needs a whole mu >= 1, got {mu2}"
            )
        return cmp.colocate_phi, round(mu2)
    mu = cmp.mu.get(kind, 1)
    phi = target - (mu - 1) / 2
    if phi < -1e-9:
        raise ValueError(f"{kind}: mu={mu} alone gives E[d]={(mu - 1) / 2} > target {target}")
    return max(phi, 0.0), mu


def compare_configs(raw: dict[str, Any]) -> tuple[CompareConfig, dict[str, SimConfig]]:
    """Split a compare config into the [compare] table and one SimConfig per policy (same workload and seed)."""
    raw = resolve(raw)
    cmp = CompareConfig.model_validate(raw.pop("compare", {}))
    out = {}
    for kind in cmp.policies:
        d = deep_merge(raw, {"policy": {"kind": kind}})
        if cmp.staleness is not None:
            phi, mu = matched(kind, cmp.staleness, cmp)
            d = deep_merge(d, {"policy": {"phi": phi, "mu": mu}})
        d = deep_merge(d, cmp.overrides.get(kind, {}))
        d["name"] = f"{d.get('name', 'sim')}-{kind}"
        out[kind] = SimConfig.model_validate(d)
    return cmp, out
