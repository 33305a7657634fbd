"""Batch metrics of docs/design/training.md#objective: clip fractions (by sign of A and by staleness d), capped-token fraction, weight stats,
mean(l - b) for d = 0 (pure engine mismatch) and d > 0, and |s - 1|. Computed once per batch by the core from the
pre-pass tallies (execution level) and the summed TokenStats (token level)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from gyre_train.loss import LossConfig, execution_gate, execution_ratio
from gyre_train.types import ExecutionInfo, TokenStats


def batch_metrics(
    executions: Iterable[ExecutionInfo], tokens: TokenStats, cfg: LossConfig
) -> dict[str, float]:
    """``executions`` must carry final ``log_ratio_sum`` (None is read as 0: proximal mode or no targets)."""
    gated = defaultdict(int)
    seen = defaultdict(int)
    lr_sum = defaultdict(float)
    lr_cnt = defaultdict(int)
    dev = []
    for e in executions:
        if e.num_targets == 0:
            continue
        lrs = e.log_ratio_sum or 0.0
        s = 1.0 if cfg.ratio_reference == "proximal" else execution_ratio(lrs, e.num_targets)
        m = execution_gate(e.advantage, s, cfg)
        dev.append(abs(s - 1.0))
        keys = ["all", f"d{e.staleness}"]
        if e.advantage > 0:
            keys.append("pos")
        elif e.advantage < 0:
            keys.append("neg")
        for k in keys:
            seen[k] += 1
            gated[k] += m == 0.0
        bucket = "d0" if e.staleness == 0 else "dpos"
        lr_sum[bucket] += lrs
        lr_cnt[bucket] += e.num_targets
    out: dict[str, float] = {}
    for k in sorted(seen):
        out[f"clip_frac_{k}"] = gated[k] / seen[k]
    for bucket in ("d0", "dpos"):
        if lr_cnt[bucket]:
            out[f"mean_log_ratio_{bucket}"] = lr_sum[bucket] / lr_cnt[bucket]
    if dev:
        out["ratio_dev_mean"] = sum(dev) / len(dev)
        out["ratio_dev_max"] = max(dev)
    if tokens.num_targets:
        out["capped_frac"] = tokens.num_capped / tokens.num_targets
        out["weight_mean"] = tokens.weight_sum / tokens.num_targets
        out["weight_max"] = tokens.weight_max
    return out
