"""Config resolution: cell size regroups the same nodes, presets, matched staleness for compare (eq. 2)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gyre_sched.config import SimConfig
from gyre_sched.presets import NL2REPO, compare_configs, deep_merge, resolve


def test_cell_size_regroups_the_same_nodes():
    four = SimConfig.model_validate(resolve({"preset": "nl2repo"}))
    eight = SimConfig.model_validate(resolve({"preset": "nl2repo", "cluster": {"nodes_per_cell": 8}}))
    p4, p8 = four.policy_params(), eight.policy_params()
    assert (p4.K, p4.C_e, p8.K, p8.C_e) == (8, 144, 4, 288)
    assert p4.K * p4.C_e == p8.K * p8.C_e  # same rollout capacity in total
    assert eight.cell_train_s_per_group() == pytest.approx(four.cell_train_s_per_group() / 2)
    sub = SimConfig.model_validate(
        deep_merge(NL2REPO, {"cost": {"train_scaling": 0.5}, "cluster": {"nodes_per_cell": 8}})
    )
    # (6 x active params + 6 x layers x width x row) x a group's J x L tokens / (GPUs x peak x MFU) per node
    flops_per_token = 6 * 10e9 + 6 * 48 * 8192 * 131_072
    node_s = flops_per_token * 16 * 5 * 131_072 / (8 * 989e12 * 0.3)
    assert sub.cell_train_s_per_group() == pytest.approx(node_s / 8**0.5)


def test_standalone_pool_capacity():
    cfg = SimConfig.model_validate(deep_merge(NL2REPO, {"cluster": {"standalone_nodes": 2}}))
    assert cfg.policy_params().C_s == 72
    cfg = SimConfig.model_validate(deep_merge(NL2REPO, {"cluster": {"standalone_nodes": 2, "C_s": 10}}))
    assert cfg.policy_params().C_s == 10


def test_compare_matches_eq2_per_policy():
    _, cfgs = compare_configs({"preset": "nl2repo", "compare": {"staleness": 1.5}})
    got = {k: (c.policy.phi, c.policy.mu) for k, c in cfgs.items()}
    assert got == {
        "elastic": (0.5, 3),
        "async": (1.5, 1),
        "colocate": (0.0, 4),
    }  # docs/design/reference-numbers.md settings
    # same workload, seed
    assert len({c.workload.model_dump_json() + str(c.seed) for c in cfgs.values()}) == 1


def test_compare_colocate_with_extra_dispatch_needs_standalone_pool():
    raw = {"preset": "nl2repo", "compare": {"staleness": 1.5, "colocate_phi": 0.5, "policies": ["colocate"]}}
    with pytest.raises(ValidationError, match="standalone pool"):
        compare_configs(raw)
    raw["compare"]["overrides"] = {"colocate": {"cluster": {"standalone_nodes": 4}}}
    _, cfgs = compare_configs(raw)
    c = cfgs["colocate"]
    assert (c.policy.phi, c.policy.mu, c.policy_params().C_s) == (0.5, 3, 144)
    with pytest.raises(ValueError, match="whole mu"):
        compare_configs({"preset": "nl2repo", "compare": {"staleness": 1.25, "policies": ["colocate"]}})


def test_policy_config_builds_params_for_a_real_run():
    from gyre_sched.config import PolicyConfig, PolicyParams

    cfg = PolicyConfig(kind="async", N=4, B=2, phi=0.5, mu=1, tau_s=1.0, async_train_cells=1, k_spare=1)
    p = cfg.params(K=3, C_e=4, C_s=2, harness_timeout_s=120.0, overall_budget_s=300.0)
    assert isinstance(p, PolicyParams)
    assert (p.kind, p.K, p.C_e, p.C_s, p.N, p.B, p.phi, p.mu, p.tau_s, p.N_d) == (
        "async",
        3,
        4,
        2,
        4,
        2,
        0.5,
        1,
        1.0,
        5,
    )
    assert (p.harness_timeout_s, p.overall_budget_s, p.async_train_cells) == (120.0, 300.0, 1)
    # the simulator derives its parameters through the same builder
    sim = SimConfig.model_validate({"policy": cfg.model_dump(), "cluster": {"nodes": 3, "nodes_per_cell": 1}})
    assert sim.policy_params() == cfg.params(
        K=3, C_e=36, C_s=0, harness_timeout_s=4 * 3600.0, overall_budget_s=5 * 3600.0
    )


def test_every_policy_knob_reaches_the_policy_core_by_its_name():
    """PolicyParams is derived from PolicyConfig, not copied field by field: a knob added to the config and not to
    the core's parameters fails here, and each one reaches the core with its value."""
    import dataclasses

    from gyre_sched.config import PolicyConfig, PolicyParams

    core = {f.name for f in dataclasses.fields(PolicyParams)}
    assert set(PolicyConfig.model_fields) <= core
    assert core - set(PolicyConfig.model_fields) == {
        "K",
        "C_e",
        "C_s",
        "harness_timeout_s",
        "overall_budget_s",
    }
    cfg = PolicyConfig(
        kind="elastic",
        N=3,
        B=4,
        phi=0.25,
        mu=2,
        rho_min=0.75,
        tau_s=7.0,
        k_spare=2,
        streaming=False,
        spares="idle",
        launch_order="predicted",
        target_staleness=0.8,
        mu_max=3,
    )
    p = cfg.params(K=4, C_e=8, C_s=0, harness_timeout_s=10.0, overall_budget_s=20.0)
    assert all(getattr(p, name) == getattr(cfg, name) for name in PolicyConfig.model_fields)


@pytest.mark.parametrize(
    ("policy", "shape", "fields"),
    [
        ({"kind": "colocate", "phi": 0.5}, {"C_s": 0}, ["phi=0.5", "C_s=0"]),
        ({"kind": "async", "async_train_cells": 2}, {"K": 2}, ["async_train_cells=2", "K=2"]),
        ({"phi": 0.25, "B": 2}, {}, ["phi=0.25", "B=2"]),
        ({"kind": "colocate", "phi": 0.0, "dispatch": "continuous"}, {}, ["dispatch=continuous"]),
        (
            {"dispatch": "continuous", "N": 4, "B": 2, "mu": 1, "phi": 0.0},
            {},
            ["2 * 4 > (K-1)*C_e + C_s = 4", "set q_c <= 1"],
        ),
        ({"dispatch": "continuous", "N": 5, "B": 1, "q_c": 1}, {}, ["1 * 5 > (K-1)*C_e + C_s = 4", "q_c=1"]),
        ({}, {"harness_timeout_s": 600.0, "overall_budget_s": 300.0}, ["harness_timeout_s=600.0"]),
        ({}, {"C_e": 0}, ["C_e=0"]),
    ],
)
def test_policy_config_invalid_combination_names_fields(policy, shape, fields):
    from gyre_sched.config import PolicyConfig

    kw = {"K": 2, "C_e": 4, "C_s": 0, "harness_timeout_s": 120.0, "overall_budget_s": 300.0, **shape}
    with pytest.raises(ValueError) as err:
        PolicyConfig(**policy).params(**kw)
    for f in fields:
        assert f in str(err.value), err.value
