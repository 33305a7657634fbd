"""The cost model: every cost a function of the model's size, the tokens trained and the hardware; explicit values
(measurements) override their formula."""

from __future__ import annotations

import pytest

from gyre_sched.config import CostConfig, SimConfig
from gyre_sched.presets import NL2REPO, NL2REPO_DENSE, deep_merge


def costs(nodes_per_cell: int = 4, N: int = 16, **over):
    return CostConfig.model_validate(NL2REPO["cost"] | over).resolve(nodes_per_cell=nodes_per_cell, N=N)


def test_preset_reproduces_the_paper_switch_times():
    c = costs()
    assert c.switch_to_training_s == pytest.approx(8.52) and c.switch_to_rollout_s == pytest.approx(3.46)


NODE_FLOPS = 8 * 989e12 * 0.3  # the preset's node: 8 GPUs x dense bf16 peak x 30% MFU
MATRICES = 6 * 10e9  # FLOPs a token: 6 x active parameters
# 6 x layers x width x row (causal: 4 x width x t forward at t, L / 2 on average)
ATTENTION = 6 * 48 * 8192 * 131_072


def test_training_follows_active_parameters_tokens_and_attention_over_the_row():
    c = costs()
    group_tokens = 16 * 5 * 131_072  # N executions x J_max trajectories x full-context rows
    # 1631
    assert c.train_node_s_per_group == pytest.approx((MATRICES + ATTENTION) * group_tokens / NODE_FLOPS)
    assert c.microsteps_per_group == 14 and c.microstep_s == pytest.approx(c.train_node_s_per_group / 4 / 14)
    assert c.pipeline_startup_s == pytest.approx(0.67 * c.microstep_s)
    double = costs(trajectories_per_execution=10.0)
    assert double.cell_train_s_per_group == pytest.approx(2 * c.cell_train_s_per_group)
    assert double.microsteps_per_group == 27  # 800k-token micro-steps: about twice as many
    longer = costs(trajectory_tokens=2 * 131_072)  # twice the tokens, each attending twice as far
    assert longer.train_node_s_per_group == pytest.approx(
        (MATRICES + 2 * ATTENTION) * 2 * group_tokens / NODE_FLOPS
    )
    no_attention = costs(attention_layers=0)
    assert no_attention.train_node_s_per_group == pytest.approx(MATRICES * group_tokens / NODE_FLOPS)
    dense = costs(active_params_b=None)
    assert dense.train_node_s_per_group == pytest.approx(
        (12.2 * MATRICES + ATTENTION) * group_tokens / NODE_FLOPS
    )
    assert costs(mfu=0.6).train_node_s_per_group == pytest.approx(c.train_node_s_per_group / 2)
    assert costs(
        node_train_tflops=1600.0, attention_layers=0, tokens_per_execution=200_000.0
    ).train_node_s_per_group == (
        # the explicit figures of the previous preset: 120 node-s
        pytest.approx(MATRICES * 16 * 200_000 / 1600e12)
    )
    assert costs(N=8).cell_train_s_per_group == pytest.approx(c.cell_train_s_per_group / 2)
    bigger_cells = costs(nodes_per_cell=8)
    assert bigger_cells.cell_train_s_per_group == pytest.approx(c.cell_train_s_per_group / 2)
    assert costs(microstep_overhead_s=2.0).microstep_s == pytest.approx(c.microstep_s + 2.0)


def test_the_basis_states_what_the_cost_comes_to():
    cost = CostConfig.model_validate(NL2REPO["cost"])
    basis = cost.basis(nodes_per_cell=4, N=16)
    assert basis["model"] == "moe" and basis["tokens_per_execution"] == 5 * 131_072
    # 84%: attention dominates
    assert basis["attention_share"] == pytest.approx(ATTENTION / (MATRICES + ATTENTION))
    assert basis["node_train_tflops"] == pytest.approx(NODE_FLOPS / 1e12)
    assert basis["cell_train_s_per_group"] == pytest.approx(costs().cell_train_s_per_group)
    assert CostConfig.model_validate(NL2REPO_DENSE["cost"]).basis(nodes_per_cell=4, N=16)["model"] == "dense"


def test_weight_moves_follow_model_size_per_node():
    c, big = costs(), costs(model_params_b=244.0)
    # 122B x 2 bytes over 4 nodes at 25 GB/s each: 2.44 s of transfer in every weight move
    for name, fixed in (
        ("switch_to_training_s", 6.08),
        ("switch_to_rollout_s", 1.02),
        ("publish_s", 10.0),
        ("optimizer_s", 20.0),
        ("broadcast_s", 0.0),
        ("satellite_join_s", 0.0),
    ):
        assert getattr(c, name) == pytest.approx(fixed + 2.44), name
        assert getattr(big, name) == pytest.approx(fixed + 4.88), name
    assert costs(nodes_per_cell=8).satellite_join_s == pytest.approx(1.22)  # more nodes share the pull
    assert c.reroute_penalty_s == pytest.approx(2 * 10e9 * 100_000 / (4 * NODE_FLOPS))


def test_explicit_values_override_formulas():
    c = costs(train_node_s_per_group=1440.0, microsteps_per_group=3, publish_s=60.0, reroute_penalty_s=0.0)
    assert (c.cell_train_s_per_group, c.microsteps_per_group, c.publish_s, c.reroute_penalty_s) == (
        360.0,
        3,
        60.0,
        0.0,
    )
    assert c.switch_to_training_s == pytest.approx(8.52)  # the others keep their formulas


def test_the_simulator_charges_the_resolved_costs():
    cfg = SimConfig.model_validate(deep_merge(NL2REPO, {"cost": {"model_params_b": 2400.0}}))
    assert cfg.costs().publish_s == pytest.approx(10.0 + 2400 * 2 / 4 / 25)
    with pytest.raises(ValueError):
        CostConfig(node_train_tflops=0.0)
