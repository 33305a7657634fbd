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
    assert sub.cell_train_s_per_group() == pytest.approx(1440.0 / 8**0.5)


def test_standalone_pool_capacity():
    cfg = SimConfig.model_validate(deep_merge(NL2REPO, {"cluster": {"standalone_nodes": 2}}))
    assert cfg.policy_params().C_s == 72
    cfg = SimConfig.model_validate(deep_merge(NL2REPO, {"cluster": {"standalone_nodes": 2, "C_s": 10}}))
    assert cfg.policy_params().C_s == 10


def test_compare_matches_eq2_per_policy():
    _, cfgs = compare_configs({"preset": "nl2repo", "compare": {"staleness": 1.5}})
    got = {k: (c.policy.phi, c.policy.mu) for k, c in cfgs.items()}
    assert got == {"elastic": (0.5, 3), "async": (1.5, 1), "colocate": (0.0, 4)}  # DESIGN §9 settings
    assert (
        len({c.workload.model_dump_json() + str(c.seed) for c in cfgs.values()}) == 1
    )  # same workload, seed


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
