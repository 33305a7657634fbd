"""The GSPO loss on hand-computed values, and the clip / cap edge cases of docs/design/training.md#objective."""

from __future__ import annotations

import math

import pytest
import torch

from gyre_train.loss import LossConfig, execution_gate, execution_ratio, gspo_token_loss
from gyre_train.metrics import batch_metrics
from gyre_train.testing.loss_reference import RefExecution, reference_loss
from gyre_train.types import ExecutionInfo, TokenStats

F64 = torch.float64


def _one_exec(l_vals, b_vals, adv, norm, cfg):
    """Core loss for one execution whose tokens are all targets; returns (loss, grad, stats)."""
    n = len(l_vals)
    l_T = torch.tensor(l_vals, dtype=F64, requires_grad=True)
    b_T = torch.tensor(b_vals, dtype=F64)
    s = execution_ratio(float((l_T.detach() - b_T).sum()), n)
    m = execution_gate(adv, s, cfg) if cfg.ratio_reference == "behaviour" else 1.0
    coef = torch.full((n,), -adv / (norm * n), dtype=F64)
    loss, stats = gspo_token_loss(
        l_T, b_T, coef, torch.full((n,), m, dtype=F64), torch.ones(n, dtype=torch.bool), cfg
    )
    loss.backward()
    return loss, l_T.grad, stats


def test_hand_computed_loss_and_gradient():
    cfg = LossConfig()
    # two tokens, rho = e^0.001 and e^-0.001 -> s = 1, no gate, no cap
    loss, grad, stats = _one_exec([-1.0, -2.0], [-1.001, -1.999], adv=2.0, norm=4, cfg=cfg)
    w = [math.exp(0.001), math.exp(-0.001)]
    assert float(loss.detach()) == pytest.approx(-(2.0 / 4) * 0.5 * (w[0] * -1.0 + w[1] * -2.0), abs=1e-15)
    assert grad.tolist() == pytest.approx([-(2.0 / 4) * 0.5 * w[0], -(2.0 / 4) * 0.5 * w[1]], abs=1e-15)
    assert stats.surrogate == pytest.approx((2.0 / 4) * 0.5 * sum(w), abs=1e-15)
    assert stats.num_targets == 2 and stats.num_capped == 0


@pytest.mark.parametrize(
    ("adv", "log_s", "gated"),
    [
        (1.0, math.log(1.005) + 1e-9, True),  # A > 0 above the upper bound
        (1.0, math.log(1.005) - 1e-9, False),  # just inside
        (1.0, math.log(0.9), False),  # A > 0 far below: GSPO's min is not flat there
        (-1.0, math.log(0.995) - 1e-9, True),  # A < 0 below the lower bound
        (-1.0, math.log(0.995) + 1e-9, False),
        (-1.0, math.log(1.2), False),  # A < 0 far above: still a gradient
        (0.0, math.log(2.0), False),  # A = 0: never gated (and contributes 0 anyway)
    ],
)
def test_execution_gate_edges(adv, log_s, gated):
    s = execution_ratio(log_s * 3, 3)
    assert execution_gate(adv, s, LossConfig()) == (0.0 if gated else 1.0)
    if adv == 0.0:
        return  # contributes nothing either way
    # the gated execution's gradient is exactly zero; an ungated one is not
    n = 3
    _, grad, _ = _one_exec([-1.0] * n, [-1.0 - log_s] * n, adv=adv, norm=1, cfg=LossConfig())
    if gated:
        assert torch.count_nonzero(grad) == 0
    else:
        assert torch.count_nonzero(grad) == n


def test_cap_truncate_and_mask():
    # log rho = [just below log 5, log 5 + 0.1, 0]: the first is not capped (rho <= C), the second is
    l_vals = [-1.0, -1.0, -1.0]
    b_vals = [-1.0 - math.log(5.0) + 1e-12, -1.1 - math.log(5.0), -1.0]
    # keep s inside the gate: the test is about token weights, so use A < 0 with s > 1 (never gated)
    for mode, second in (("truncate", 5.0), ("mask", 0.0)):
        cfg = LossConfig(cap_mode=mode)
        _, grad, stats = _one_exec(l_vals, b_vals, adv=-1.0, norm=1, cfg=cfg)
        w = (grad / (1.0 / 3)).tolist()  # grad = -(A/(N B |T|)) w = w / 3
        assert w == pytest.approx([5.0, second, 1.0], abs=1e-10)
        assert stats.num_capped == 1
        assert stats.weight_max == pytest.approx(5.0)


def test_off_target_positions_are_ignored_even_if_infinite():
    cfg = LossConfig()
    l_T = torch.tensor([-float("inf"), -1.0, float("nan")], dtype=F64, requires_grad=True)
    target = torch.tensor([False, True, False])
    loss, stats = gspo_token_loss(
        l_T,
        torch.tensor([0.0, -1.0, 0.0], dtype=F64),
        torch.full((3,), -1.0, dtype=F64),
        torch.ones(3, dtype=F64),
        target,
        cfg,
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(1.0) and stats.num_targets == 1
    assert l_T.grad.tolist() == [0.0, -1.0, 0.0]


def test_reference_matches_core_and_skips_empty_executions():
    cfg = LossConfig()
    execs = [
        RefExecution(1.0, torch.tensor([-1.0, -2.0], dtype=F64), torch.tensor([-1.001, -1.999], dtype=F64)),
        RefExecution(-0.5, torch.zeros(0, dtype=F64), torch.zeros(0, dtype=F64)),
    ]
    ref = reference_loss(execs, 4, cfg)
    core, _, _ = _one_exec([-1.0, -2.0], [-1.001, -1.999], adv=1.0, norm=4, cfg=cfg)
    assert float(ref) == pytest.approx(float(core.detach()), abs=1e-15)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="cap_mode"):
        LossConfig(cap_mode="clip")
    with pytest.raises(ValueError, match="ratio_reference"):
        LossConfig(ratio_reference="old")
    with pytest.raises(ValueError, match="weight_cap"):
        LossConfig(weight_cap=0)


def test_batch_metrics_split_by_sign_and_staleness():
    def info(eid, adv, d, lrs, n=10):
        return ExecutionInfo(
            execution_id=eid, group_id="g", advantage=adv, num_targets=n, staleness=d, log_ratio_sum=lrs
        )

    execs = [
        info("a", 1.0, 0, 10 * math.log(1.01)),  # A>0, s=1.01 -> gated
        info("b", 1.0, 1, 0.0),  # not gated
        info("c", -1.0, 1, 10 * math.log(0.99)),  # A<0, s=0.99 -> gated
        info("d", -1.0, 0, 0.0),
        info("e", 0.0, 0, 0.0, n=0),  # placeholder: ignored
    ]
    stats = TokenStats(num_targets=40, num_capped=4, weight_sum=42.0, weight_max=5.0)
    m = batch_metrics(execs, stats, LossConfig())
    assert m["clip_frac_pos"] == 0.5 and m["clip_frac_neg"] == 0.5 and m["clip_frac_all"] == 0.5
    assert m["clip_frac_d0"] == 0.5 and m["clip_frac_d1"] == 0.5
    assert m["capped_frac"] == 0.1 and m["weight_mean"] == pytest.approx(1.05) and m["weight_max"] == 5.0
    assert m["mean_log_ratio_d0"] == pytest.approx(math.log(1.01) / 2)
    assert m["mean_log_ratio_dpos"] == pytest.approx(math.log(0.99) / 2)
    assert m["ratio_dev_max"] == pytest.approx(0.01)
