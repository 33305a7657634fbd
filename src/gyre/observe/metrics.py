"""Metrics of a run as TensorBoard event files under RUN/metrics/ (and Weights & Biases when installed and configured).

The run monitor calls `MetricsSink.step(row)` as each optimizer step ends (the row the controller appends to
metrics/steps.jsonl) and `MetricsSink.interval(...)` every `[metrics] interval_s`; each write is flushed at once, so
`tensorboard --logdir RUN/metrics` follows a run as it goes.

Per step (TensorBoard step = the policy version the step produced, 1, 2, ...):

| tag | what |
|---|---|
| reward/mean, reward/std | rewards of the step's groups (the N counted members of each group) |
| loss/loss, loss/surrogate | the GSPO objective and its surrogate term |
| optim/grad_norm | global gradient norm before clipping |
| optim/lr | learning rate of the step's update (NaN where the backend reports none) |
| clip/frac_all, clip/frac_pos_adv, clip/frac_neg_adv | sequence clip fractions, all and by sign of A |
| clip/frac_d0, clip/frac_d1, ... | by staleness d of the execution (d0 always; d >= 1 when the step has such groups) |
| is/capped_frac | fraction of target tokens whose importance weight was capped |
| is/w_mean, is/w_max | token importance weights |
| is/mean_l_minus_b_d0, is/mean_l_minus_b_dpos | mean(l - b) per target token, d = 0 (engine mismatch) and d > 0 |
| is/ratio_dev_mean, is/ratio_dev_max | abs(s - 1) of the sequence ratios |
| staleness/mean, staleness/max | staleness of the step's groups |
| tokens/targets | target tokens of the step |
| microsteps/cell{i}, microsteps/total | micro-steps each cell claimed (0 for a cell that claimed none) |
| train/step_s, train/training_cells | step time on the core, cells in training at the step's end |

A value the step cannot define (no group with A > 0, no token at d > 0, ...) is written as NaN rather than left out,
so every tag has a point at every step and a gap reads as "nothing to measure".

Per interval (TensorBoard step = whole seconds since the run started):
executions/running, executions/queued, scheduler/waterlevel, scheduler/capacity, cells/share_rollout,
cells/share_training, cells/share_switching, rollout/tokens_per_s (output tokens of the calls recorded in the
interval), proxy/latency_p50_s and proxy/latency_p99_s (request to last token, calls of the interval; NaN when none).

Per event: switch/total_s (step = switch number, 1, 2, ...), publish/total_s and publish/core_s (step = version).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gyre.observe.rundata import Call, percentile

__all__ = [
    "INTERVAL_TAGS",
    "STEP_TAGS",
    "MetricsSink",
    "interval_scalars",
    "step_scalars",
]

log = logging.getLogger("gyre")
NAN = float("nan")

STEP_TAGS = (
    "reward/mean",
    "reward/std",
    "loss/loss",
    "loss/surrogate",
    "optim/grad_norm",
    "optim/lr",
    "clip/frac_all",
    "clip/frac_pos_adv",
    "clip/frac_neg_adv",
    "clip/frac_d0",
    "is/capped_frac",
    "is/w_mean",
    "is/w_max",
    "is/mean_l_minus_b_d0",
    "is/mean_l_minus_b_dpos",
    "is/ratio_dev_mean",
    "is/ratio_dev_max",
    "staleness/mean",
    "staleness/max",
    "tokens/targets",
    "microsteps/total",
    "train/step_s",
    "train/training_cells",
)
"""Tags every step has (plus microsteps/cell{i} for each cell and clip/frac_d{k} for each staleness k > 0 seen)."""

INTERVAL_TAGS = (
    "executions/running",
    "executions/queued",
    "scheduler/waterlevel",
    "scheduler/capacity",
    "cells/share_rollout",
    "cells/share_training",
    "cells/share_switching",
    "rollout/tokens_per_s",
    "proxy/latency_p50_s",
    "proxy/latency_p99_s",
)


def _num(value: Any) -> float:
    return NAN if value is None else float(value)


def step_scalars(row: dict, cells: int) -> dict[str, float]:
    """The per-step scalars of one steps.jsonl row (see the table above)."""
    m = row.get("metrics") or {}
    st = [int(d) for d in row.get("staleness") or []]
    by_cell = {str(k): int(v) for k, v in (row.get("microsteps_by_cell") or {}).items()}
    out = {
        "reward/mean": _num(row.get("mean_reward")),
        "reward/std": _num(row.get("reward_std")),
        "loss/loss": _num(row.get("loss")),
        "loss/surrogate": _num(row.get("surrogate")),
        "optim/grad_norm": _num(row.get("grad_norm")),
        "optim/lr": _num(m.get("lr")),
        "clip/frac_all": _num(m.get("clip_frac_all")),
        "clip/frac_pos_adv": _num(m.get("clip_frac_pos")),
        "clip/frac_neg_adv": _num(m.get("clip_frac_neg")),
        "clip/frac_d0": _num(m.get("clip_frac_d0")),
        "is/capped_frac": _num(m.get("capped_frac")),
        "is/w_mean": _num(m.get("weight_mean")),
        "is/w_max": _num(m.get("weight_max")),
        "is/mean_l_minus_b_d0": _num(m.get("mean_log_ratio_d0")),
        "is/mean_l_minus_b_dpos": _num(m.get("mean_log_ratio_dpos")),
        "is/ratio_dev_mean": _num(m.get("ratio_dev_mean")),
        "is/ratio_dev_max": _num(m.get("ratio_dev_max")),
        "staleness/mean": sum(st) / len(st) if st else NAN,
        "staleness/max": float(max(st)) if st else NAN,
        "tokens/targets": _num(row.get("num_target_tokens")),
        "microsteps/total": float(sum(by_cell.values())),
        "train/step_s": _num(row.get("seconds")),
        "train/training_cells": _num(row.get("training_cells")),
    }
    for key, value in m.items():
        if key.startswith("clip_frac_d") and key[len("clip_frac_d") :].isdigit():
            out[f"clip/frac_{key[len('clip_frac_') :]}"] = float(value)
    for i in range(max([cells, *(int(k) + 1 for k in by_cell)])):
        out[f"microsteps/cell{i}"] = float(by_cell.get(str(i), 0))
    return out


def interval_scalars(state: dict, calls: Iterable[Call], seconds: float) -> dict[str, float]:
    """Scheduler state now (`live_state` of the monitor) and the calls the proxy recorded over `seconds`."""
    calls = list(calls)
    roles = state.get("roles") or []
    k = len(roles) or 1
    latency = [c.latency_s for c in calls]
    return {
        "executions/running": float(state["running"]),
        "executions/queued": float(state["queued"]),
        "scheduler/waterlevel": float(state["waterlevel"]),
        "scheduler/capacity": float(state["capacity"]),
        "cells/share_rollout": sum(r == "rollout" for r in roles) / k,
        "cells/share_training": sum(r == "training" for r in roles) / k,
        "cells/share_switching": sum(r not in ("rollout", "training") for r in roles) / k,
        "rollout/tokens_per_s": sum(c.output_tokens for c in calls) / seconds if seconds > 0 else NAN,
        "proxy/latency_p50_s": percentile(latency, 50) if latency else NAN,
        "proxy/latency_p99_s": percentile(latency, 99) if latency else NAN,
    }


class _TensorBoard:
    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(logdir), max_queue_size=1000, flush_secs=5)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=tag, simple_value=v) for tag, v in scalars.items()]
        event = self._event(wall_time=time.time(), step=int(step), summary=self._summary(value=values))
        self._writer.add_event(event)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    """Weights & Biases, when the package is importable and `[metrics] wandb_project` is set."""

    def __init__(self, project: str, entity: str | None, run_dir: Path, config: dict) -> None:
        import wandb

        self._run = wandb.init(
            project=project, entity=entity, name=run_dir.name, dir=str(run_dir / "metrics"), config=config
        )
        self._run.define_metric("step")
        self._run.define_metric("time_s")
        for prefix in ("reward", "loss", "optim", "clip", "is", "staleness", "tokens", "microsteps", "train"):
            self._run.define_metric(f"{prefix}/*", step_metric="step")
        for prefix in ("executions", "scheduler", "cells", "rollout", "proxy"):
            self._run.define_metric(f"{prefix}/*", step_metric="time_s")
        for prefix in ("switch", "publish"):
            self._run.define_metric(f"{prefix}/*", step_metric="event")

    def log(self, axis: str, step: float, scalars: dict[str, float]) -> None:
        self._run.log({axis: step, **{k: v for k, v in scalars.items() if not math.isnan(v)}})

    def close(self) -> None:
        self._run.finish()


class MetricsSink:
    """Writes every metric as it is made; `close()` flushes. Used by gyre.observe.monitor during a run."""

    def __init__(
        self,
        run_dir: Path,
        cells: int,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        config: dict | None = None,
    ) -> None:
        self.run_dir, self.cells = Path(run_dir), cells
        self.tb = _TensorBoard(self.run_dir / "metrics") if tensorboard else None
        self.wandb = None
        if wandb_project:
            try:
                self.wandb = _Wandb(wandb_project, wandb_entity, self.run_dir, config or {})
            except ImportError:
                log.warning("[metrics] wandb_project is set but wandb is not installed: TensorBoard only")
        self._switches = 0
        self._published: set[int] = set()

    def _write(self, axis: str, step: float, scalars: dict[str, float]) -> None:
        if self.tb is not None:
            self.tb.write(int(step), scalars)
        if self.wandb is not None:
            self.wandb.log(axis, step, scalars)

    def step(self, row: dict) -> dict[str, float]:
        scalars = step_scalars(row, self.cells)
        self._write("step", int(row["policy_version"]), scalars)
        return scalars

    def interval(self, t: float, state: dict, calls: Iterable[Call], seconds: float) -> dict[str, float]:
        scalars = interval_scalars(state, calls, seconds)
        self._write("time_s", round(t), scalars)
        return scalars

    def switches(self, rows: Iterable[dict]) -> None:
        for row in rows:
            self._switches += 1
            self._write("event", self._switches, {"switch/total_s": float(row["total_s"])})

    def publishes(self, rows: Iterable[dict]) -> None:
        for row in rows:
            v = int(row["version"])
            if v not in self._published:
                self._published.add(v)
                self._write(
                    "event",
                    v,
                    {"publish/total_s": float(row["total_s"]), "publish/core_s": float(row["core_s"])},
                )

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
