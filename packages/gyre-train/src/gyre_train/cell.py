"""A training cell's worker: runs claimed work items on its backend.

``prepass`` items: forward only, per-execution partial sums of (l_t - b_t) over the micro-step's targets (all
shards: the cell's data-parallel ranks; a one-process backend runs them in turn). ``train`` items: forward-backward
of every shard with the pre-scaled GSPO loss; gradients accumulate in the backend as a plain sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre_train.backends.base import PackedTensors, TrainBackend
from gyre_train.loss import LossConfig, make_loss_fn, prepass_partials
from gyre_train.types import ExecutionPartial, PrepassResult, TokenStats, TrainResult, WorkItem


@dataclass(slots=True)
class CellWorker:
    """Runs work items for cell ``cell`` on ``backend``."""

    cell: int
    backend: TrainBackend
    loss: LossConfig

    def run(self, item: WorkItem) -> PrepassResult | TrainResult:
        ms = item.microstep
        if item.kind == "prepass":
            n = len(ms.executions)
            sums, counts = [0.0] * n, [0] * n
            for shard in ms.shards:
                l_T = self.backend.logprobs(PackedTensors.from_shard(shard), ms.temperature)
                s, c = prepass_partials(shard, l_T, n)
                sums = [a + b for a, b in zip(sums, s, strict=True)]
                counts = [a + b for a, b in zip(counts, c, strict=True)]
            partials = [
                ExecutionPartial(execution_id=e.execution_id, log_ratio_sum=s, count=c)
                for e, s, c in zip(ms.executions, sums, counts, strict=True)
                if c
            ]
            return PrepassResult(batch=ms.batch, index=ms.index, cell=self.cell, partials=partials)
        stats = TokenStats()
        partials = []
        for r, shard in enumerate(ms.shards):
            loss_fn = make_loss_fn(ms, r, self.loss, dtype=torch.float64)
            packed = PackedTensors.from_shard(shard)
            stats = stats + self.backend.forward_backward(packed, ms.temperature, loss_fn)
            partials += loss_fn.partials  # single-pass executions (no pre-pass): their s_i sums
        return TrainResult(batch=ms.batch, index=ms.index, cell=self.cell, stats=stats, partials=partials)
