"""GSPO with token-level importance weights and execution-level clipping (docs/design/training.md#objective), split-invariant.

The batch loss is

    L = -(1 / (N B)) * sum_i m_i * A_i * (1 / |T_i|) * sum_{t in T_i} w_t * l_t

with everything but l_t detached. It is a plain sum over target tokens of ``coef_t * gate_t * w_t * l_t`` where

    coef_t = -A_i / (N B |T_i|)      known when the batch is packed (ExecutionInfo.advantage / num_targets, MicroStep.norm)
    gate_t = m_i                     from s_i = exp(log_ratio_sum_i / |T_i|), known after the forward-only pre-pass
    w_t    = min(rho_t, C)           rho_t = exp(sg(l_t) - b_t), computed from the current forward

so any split of the target tokens over rows, data-parallel ranks, micro-steps and cells gives the same loss and the
same gradient, and gradients aggregate by a plain fp32 sum (no 1/num_microbatches, no DP averaging).

Contract with backends (``backends/base.py``): a backend computes ``l_t = log_softmax(logits / T)[labels_t]`` in at
least fp32 for a packed shard and calls a loss function built here (:func:`make_loss_fn`) on it; the returned
scalar's gradient is already the micro-step's pre-scaled contribution to the batch gradient, and backends simply
``backward()`` it into fp32 ``.grad`` accumulators. :func:`gspo_token_loss` is the backend-agnostic core on per-token
tensors ([T] each) for backends that build their own tensors (e.g. Megatron's loss_func).

``ratio_reference = "proximal"``: ratios are taken against the recomputed (current) weights, i.e. ``b_t := sg(l_t)``;
with one update per batch this gives ``s_i == 1``, ``rho_t == 1`` and the gate never fires (an ablation).
"""

from __future__ import annotations

import math

import torch

# LossConfig lives in a torch-free module so that configs embedding it (gyre.config) load without torch; it is
# re-exported here, next to the loss that reads it.
from gyre_train.loss_config import LossConfig
from gyre_train.types import ExecutionInfo, ExecutionPartial, MicroStep, Shard, TokenStats

# --- execution level -------------------------------------------------------------------------------------------


def execution_ratio(log_ratio_sum: float, num_targets: int) -> float:
    """s_i = exp(sum_{t in T_i} (sg(l_t) - b_t) / |T_i|); 1.0 for an execution without targets."""
    if num_targets == 0:
        return 1.0
    return math.exp(log_ratio_sum / num_targets)


def execution_gate(advantage: float, ratio: float, cfg: LossConfig) -> float:
    """m_i: 0 where GSPO's min(s A, clip(s) A) is flat in s, else 1."""
    if advantage > 0 and ratio > 1.0 + cfg.eps_high:
        return 0.0
    if advantage < 0 and ratio < 1.0 - cfg.eps_low:
        return 0.0
    return 1.0


def execution_coefficients(executions: list[ExecutionInfo], norm: int, cfg: LossConfig) -> tuple[list, list]:
    """Per-execution (coef_i, gate_i) with coef_i = -A_i / (N B |T_i|) and gate_i = m_i.

    In behaviour mode every execution with targets must carry its pre-pass ``log_ratio_sum``.
    """
    coefs, gates = [], []
    for e in executions:
        if e.num_targets == 0:
            coefs.append(0.0)
            gates.append(0.0)
            continue
        if cfg.ratio_reference == "proximal":
            ratio = 1.0
        else:
            if e.log_ratio_sum is None:
                raise ValueError(f"execution {e.execution_id} has no pre-pass log_ratio_sum")
            ratio = execution_ratio(e.log_ratio_sum, e.num_targets)
        coefs.append(-e.advantage / (norm * e.num_targets))
        gates.append(execution_gate(e.advantage, ratio, cfg))
    return coefs, gates


# --- token level -----------------------------------------------------------------------------------------------


def token_weights(
    logprobs_T: torch.Tensor, behavior_T: torch.Tensor, target_T: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_T, capped_T): detached token weights (0 off-target) and the mask of tokens with rho_t > C."""
    lsg_T = logprobs_T.detach()
    if cfg.ratio_reference == "proximal":
        log_rho_T = torch.zeros_like(lsg_T)
    else:
        log_rho_T = torch.where(target_T, lsg_T - behavior_T.to(lsg_T.dtype), torch.zeros_like(lsg_T))
    rho_T = torch.exp(log_rho_T)
    capped_T = target_T & (rho_T > cfg.weight_cap)
    if cfg.cap_mode == "truncate":
        w_T = torch.clamp(rho_T, max=cfg.weight_cap)
    else:
        w_T = torch.where(capped_T, torch.zeros_like(rho_T), rho_T)
    w_T = torch.where(target_T, w_T, torch.zeros_like(w_T))
    return w_T, capped_T


def gspo_token_loss(
    logprobs_T: torch.Tensor,
    behavior_T: torch.Tensor,
    coef_T: torch.Tensor,
    gate_T: torch.Tensor,
    target_T: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, TokenStats]:
    """Core loss on per-token tensors (all [T]); returns (scalar with grad through logprobs_T only, stats).

    logprobs_T: current l_t (grad); behavior_T: b_t; coef_T: -A_i/(N B |T_i|); gate_T: m_i; target_T: bool.
    Off-target entries of every input are ignored (their logprobs may be anything finite or not).
    """
    w_T, capped_T = token_weights(logprobs_T, behavior_T, target_T, cfg)
    scale_T = (coef_T.to(w_T.dtype) * gate_T.to(w_T.dtype) * w_T).detach()
    safe_l_T = torch.where(target_T, logprobs_T, torch.zeros_like(logprobs_T))
    loss = (scale_T * safe_l_T).sum()
    n = int(target_T.sum())
    stats = TokenStats(
        loss=float(loss.detach()),
        surrogate=float(-(scale_T.sum())),
        num_targets=n,
        num_capped=int(capped_T.sum()),
        weight_sum=float(w_T.sum()),
        weight_max=float(w_T.max()) if n else 0.0,
    )
    return loss, stats


def shard_coefficients(shard: Shard, coefs: list, gates: list, dtype: torch.dtype) -> tuple:
    """Expand per-execution (coef, gate) to per-token tensors of a shard: (coef_T, gate_T, target_T)."""
    slot_T = torch.tensor(shard.exec_slot, dtype=torch.long)
    target_T = slot_T >= 0
    idx_T = slot_T.clamp(min=0)
    coef_E = torch.tensor([*coefs, 0.0], dtype=dtype)
    gate_E = torch.tensor([*gates, 0.0], dtype=dtype)
    coef_T = torch.where(target_T, coef_E[idx_T], torch.zeros((), dtype=dtype))
    gate_T = torch.where(target_T, gate_E[idx_T], torch.zeros((), dtype=dtype))
    return coef_T, gate_T, target_T


class ShardLoss:
    """Loss function of one shard of a micro-step: ``loss_fn(logprobs_T) -> (scalar, TokenStats)``.

    Executions whose ``log_ratio_sum`` is None (only allowed when all their targets lie in this shard: the queue's
    single-pass path) get s_i from this very forward (detached), so no pre-pass is needed for them; their partial
    sums are left in ``partials`` for the caller to report.
    """

    def __init__(self, microstep: MicroStep, shard_index: int, cfg: LossConfig, dtype: torch.dtype) -> None:
        self.microstep, self.shard, self.cfg, self.dtype = (
            microstep,
            microstep.shards[shard_index],
            cfg,
            dtype,
        )
        self.behavior_T = torch.tensor(self.shard.behavior_logprobs, dtype=torch.float64)
        self.partials: list[ExecutionPartial] = []
        self._missing = [
            k
            for k, e in enumerate(microstep.executions)
            if e.log_ratio_sum is None and e.num_targets and cfg.ratio_reference == "behaviour"
        ]
        self._coefs = None if self._missing else self._coefficients(microstep.executions)

    def _coefficients(self, executions: list[ExecutionInfo]) -> tuple:
        coefs, gates = execution_coefficients(executions, self.microstep.norm, self.cfg)
        return shard_coefficients(self.shard, coefs, gates, self.dtype)

    def __call__(self, logprobs_T: torch.Tensor) -> tuple[torch.Tensor, TokenStats]:
        coefs = self._coefs
        if coefs is None:  # single pass: the whole execution is in this shard
            execs = list(self.microstep.executions)
            sums, counts = prepass_partials(self.shard, logprobs_T, len(execs))
            for k in self._missing:
                e = execs[k]
                if counts[k] != e.num_targets:
                    raise ValueError(
                        f"execution {e.execution_id}: {counts[k]} of {e.num_targets} targets in this shard; "
                        "the single-pass path needs them all (run the pre-pass)"
                    )
                execs[k] = e.model_copy(update={"log_ratio_sum": sums[k]})
                self.partials.append(
                    ExecutionPartial(execution_id=e.execution_id, log_ratio_sum=sums[k], count=counts[k])
                )
            coefs = self._coefficients(execs)
        dev = logprobs_T.device
        coef_T, gate_T, target_T = (t.to(dev) for t in coefs)
        return gspo_token_loss(logprobs_T, self.behavior_T.to(dev), coef_T, gate_T, target_T, self.cfg)


def make_loss_fn(
    microstep: MicroStep, shard_index: int, cfg: LossConfig, dtype: torch.dtype = torch.float32
) -> ShardLoss:
    """Loss function for one shard of a micro-step (see :class:`ShardLoss`)."""
    return ShardLoss(microstep, shard_index, cfg, dtype)


def single_pass_ok(microstep: MicroStep) -> bool:
    """True if every execution of the micro-step has all its |T_i| targets inside one shard of it."""
    where: dict[int, set[int]] = {}
    counts: dict[int, int] = {}
    for r, shard in enumerate(microstep.shards):
        for slot in shard.exec_slot:
            if slot >= 0:
                where.setdefault(slot, set()).add(r)
                counts[slot] = counts.get(slot, 0) + 1
    return all(
        len(where.get(k, ())) <= 1 and counts.get(k, 0) == e.num_targets
        for k, e in enumerate(microstep.executions)
    )


def prepass_partials(shard: Shard, logprobs_T: torch.Tensor, num_executions: int) -> tuple[list, list]:
    """Per-execution partial (sum (l_t - b_t), count) of one shard from forward-only log-probs, in float64."""
    slot_T = torch.tensor(shard.exec_slot, dtype=torch.long)
    target_T = slot_T >= 0
    diff_T = logprobs_T.detach().to(torch.float64).cpu() - torch.tensor(
        shard.behavior_logprobs, dtype=torch.float64
    )
    sums = torch.zeros(num_executions, dtype=torch.float64)
    counts = torch.zeros(num_executions, dtype=torch.long)
    sums.index_add_(0, slot_T[target_T], diff_T[target_T])
    counts.index_add_(0, slot_T[target_T], torch.ones_like(slot_T[target_T]))
    return sums.tolist(), counts.tolist()
