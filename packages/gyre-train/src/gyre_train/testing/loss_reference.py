"""Float64 reference of docs/design/training.md#objective, written literally, execution by execution, with no packing and no splitting.

Tests compare the streaming path (packing -> micro-steps -> pre-pass -> per-token coefficients -> summed grads)
against this. ``trajectory_target_logprobs`` runs one unpacked trajectory through an HF model to get its targets'
l_t, an independent path from the packed backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gyre_train.loss import LossConfig


@dataclass(frozen=True, slots=True)
class RefExecution:
    """One execution of the batch: its advantage and the l_t / b_t of all its target tokens T_i."""

    advantage: float
    logprobs: torch.Tensor  # [|T_i|] current l_t, with grad
    behavior: torch.Tensor  # [|T_i|] b_t


def reference_loss(executions: Sequence[RefExecution], norm: int, cfg: LossConfig) -> torch.Tensor:
    """L = -(1/(N B)) sum_i m_i A_i (1/|T_i|) sum_{t in T_i} w_t l_t, in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for e in executions:
        n = e.logprobs.numel()
        if n == 0:
            continue
        lp = e.logprobs.to(torch.float64)
        b = e.behavior.to(torch.float64)
        if cfg.ratio_reference == "proximal":
            b = lp.detach()
        s = torch.exp((lp.detach() - b).sum() / n)
        a = e.advantage
        m = 0.0 if (a > 0 and s > 1 + cfg.eps_high) or (a < 0 and s < 1 - cfg.eps_low) else 1.0
        rho = torch.exp(lp.detach() - b)
        w = (
            torch.clamp(rho, max=cfg.weight_cap)
            if cfg.cap_mode == "truncate"
            else rho * (rho <= cfg.weight_cap)
        )
        total = total + m * a * (1.0 / n) * (w * lp).sum()
    return -total / norm


def trajectory_target_logprobs(model, trajectory, temperature: float) -> torch.Tensor:
    """l_t (with grad) of a trajectory's targets, in target order, from one unpacked forward of ``model``."""
    mask = torch.tensor(trajectory.target_mask, dtype=torch.bool)
    if not bool(mask.any()):
        return torch.zeros(0, dtype=torch.float64)
    ids = torch.tensor(trajectory.token_ids, dtype=torch.long)
    logits = model(input_ids=ids[None], use_cache=False).logits[0]  # [n, V]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    temps = getattr(trajectory, "temperatures", None)  # recorded per call: they take precedence
    if temps is not None:
        temperature = torch.tensor([t if t > 0 else 1.0 for t in temps[1:]], dtype=dtype)[:, None]
    lp = torch.log_softmax(logits[:-1].to(dtype) / temperature, dim=-1)  # position p predicts token p+1
    lp = lp.gather(-1, ids[1:, None]).squeeze(-1)
    return lp[mask[1:]]
