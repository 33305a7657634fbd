"""The core's batch loop: trajectory buffer -> stream packing -> micro-step queue -> cells -> one optimizer update.

One :class:`Trainer` lives in the core cell. Per step it opens a batch (the packing buffer selects B groups
incrementally, oldest policy version first), keeps the shared queue fed ``queue_ahead`` micro-steps ahead of the
cells, lets cells claim work, and when the stream is closed and drained, sums the pre-scaled gradients of every
participating cell (plain sum), clips the global norm once, makes one Adam update and reports.

``step()`` runs everything in this process: the core's own worker plus optional in-process satellite workers that
join after the core has processed ``join_after`` items (they load the core's weight snapshot when they join). The
multi-process version (``gyre_train.multicell``) uses the same open/pump/claim/finish pieces with satellites in
other processes.

Trace events (``on_event(ev, fields)``, docs/design/architecture.md#run-directory-and-trace), each emitted at the moment it happens:

- ``batch_open`` (batch);
- ``group_assigned`` (group_id, batch): the packing buffer pulled the group into the open batch (lazily, oldest v_d
  first), before any micro-step holding its rows is in the queue;
- ``microstep_claim`` (cell, kind, batch, index, groups): a cell claimed a pre-pass or train item; ``groups`` is the
  sorted list of group ids whose executions the micro-step holds (each was assigned earlier);
- ``step_end`` (version, groups, staleness).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.errors import DataStarvation
from gyre_train.loss import LossConfig
from gyre_train.metrics import batch_metrics
from gyre_train.packing import PackingConfig, StreamPackingBuffer
from gyre_train.queue import MicroStepQueue
from gyre_train.types import PrepassResult, StepReport, WorkItem


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """Settings of the core's training loop."""

    packing: PackingConfig
    """Stream packing buffer settings (N, B, shard size, dp size, window, temperature)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """GSPO objective settings."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip, applied once per step by the core."""
    queue_ahead: int = 2
    """Keep at least this many unclaimed micro-steps in the queue while groups are available."""
    single_pass: bool = True
    """Skip the pre-pass for micro-steps holding each of their executions whole inside one shard."""


class Trainer:
    """The core's trainer (see the module docstring)."""

    def __init__(self, cfg: TrainerConfig, core: CellWorker, buffer: TrajectoryBuffer) -> None:
        self.cfg = cfg
        self.core = core
        self.buffer = buffer
        self.packer = StreamPackingBuffer(cfg.packing, buffer)
        self.queue = MicroStepQueue(
            prepass=cfg.loss.ratio_reference == "behaviour", single_pass=cfg.single_pass
        )
        self.version = 0
        """Policy version = optimizer steps taken."""
        self._opened_at = 0.0
        self.in_batch = False
        """True from open_batch until finish (checkpoints are only taken outside)."""
        self.on_event: Callable[[str, dict], None] | None = None
        """Optional sink for trace events (docs/design/architecture.md#run-directory-and-trace): batch_open, group_assigned, microstep_claim, step_end."""
        self._pump_lock = threading.Lock()  # the core's main thread and the coordinator's threads both pump
        self.packer.on_group = lambda group, batch: self._emit(
            "group_assigned", group_id=group.group_id, batch=batch
        )

    # --- batch pieces ----------------------------------------------------------------------------------------

    def open_batch(self) -> None:
        self.in_batch = True
        # Both streams open under the pump lock: a satellite's claim that pumped between the two saw the previous
        # batch's packer closed and closed the new queue ("the stream of this batch is closed" ended a normal run).
        with self._pump_lock:
            self.queue.open(self.version)
            self.packer.open_batch(self.version, self.version)
        self._opened_at = time.perf_counter()
        self._emit("batch_open", batch=self.version)
        self.pump()

    def _emit(self, ev: str, **fields) -> None:
        if self.on_event is not None:
            self.on_event(ev, fields)

    def pump(self) -> None:
        """Feed the queue from the packing buffer; close the stream after the batch's last micro-step."""
        with self._pump_lock:
            self._pump_locked()

    def _pump_locked(self) -> None:
        while not self.packer.closed and self.queue.unclaimed < self.cfg.queue_ahead:
            microsteps = self.packer.next_microsteps(max_microsteps=self.cfg.queue_ahead)
            for ms in microsteps:
                self.queue.put(ms)
            if not microsteps:
                break  # waiting for ready groups
        if self.packer.closed:
            self.queue.close()

    def run_one(self, worker: CellWorker) -> bool:
        """Claim and run one item on ``worker``; False if nothing was claimable."""
        item = self.claim(worker.cell)
        if item is None:
            return False
        self.report(worker.run(item))
        return True

    def report(self, result) -> None:
        if isinstance(result, PrepassResult):
            self.queue.report_prepass(result)
        else:
            self.queue.report_train(result)
        self.pump()

    def claim(self, cell: int) -> WorkItem | None:
        self.pump()
        item = self.queue.claim(cell)
        if item is not None:
            ms = item.microstep
            groups = sorted({e.group_id for e in ms.executions})
            self._emit(
                "microstep_claim", cell=cell, kind=item.kind, batch=ms.batch, index=ms.index, groups=groups
            )
        return item

    @property
    def starving(self) -> bool:
        """Nothing claimable, stream open, and no ready group to pull."""
        return (
            not self.queue.finished
            and self.queue.unclaimed == 0
            and not self.packer.closed
            and self.buffer.num_ready == 0
        )

    def finish(
        self,
        other_grads: Sequence[torch.Tensor] = (),
        microsteps_by_cell: dict | None = None,
        dump_dir: str | Path | None = None,
    ) -> StepReport:
        """Sum gradients (core + others, plain fp32/fp64 sum), clip once, one update, report.

        ``dump_dir``: also write the batch for an exactness check (``gyre_train.replay.dump_batch``): the parameters
        it was trained at, every train item as trained, the summed gradient before clipping, and the report.
        """
        if not self.queue.finished:
            raise RuntimeError("the batch is not finished")
        backend = self.core.backend
        if other_grads:
            total = backend.flat_grads()
            for g in other_grads:
                total = total + g.to(total.dtype)
            backend.set_flat_grads(total)
        if dump_dir is not None:  # weights are frozen during accumulation: these are the batch's parameters
            params_before, summed_grads = backend.flat_params().clone(), backend.flat_grads().clone()
        current_lr = getattr(backend, "current_lr", None)  # torch: its warm-up schedule; megatron: constant
        lr = current_lr() if current_lr is not None else None  # read before the step: the lr this step uses
        grad_norm = backend.optimizer_step(self.cfg.max_grad_norm)
        stats = self.queue.token_stats
        execs = [
            t.info.model_copy(update={"log_ratio_sum": t.log_ratio_sum})
            for t in self.queue.tallies().values()
        ]
        known = {e.execution_id for e in execs}
        execs += [
            e for e in self.packer.executions if e.execution_id not in known
        ]  # no targets (placeholders)
        groups = self.packer.groups
        metrics = batch_metrics(execs, stats, self.cfg.loss)
        if lr is not None:
            metrics["lr"] = lr
        report = StepReport(
            step=self.version,
            policy_version=self.version + 1,
            loss=stats.loss,
            surrogate=stats.surrogate,
            grad_norm=grad_norm,
            num_groups=len(groups),
            num_executions=len(self.packer.executions),
            num_target_tokens=stats.num_targets,
            num_microsteps=sum(self.queue.trained_by_cell.values()),
            microsteps_by_cell=dict(microsteps_by_cell or self.queue.trained_by_cell),
            group_ids=[g.group_id for g in groups],
            staleness=[self.version - g.policy_version for g in groups],
            metrics=metrics,
            seconds=time.perf_counter() - self._opened_at,
        )
        if dump_dir is not None:
            from gyre_train.replay import dump_batch

            dump_batch(
                dump_dir,
                params_before=params_before,
                microsteps=self.queue.trained_items(),
                summed_grads=summed_grads,
                report=report,
            )
        self.version += 1
        self.in_batch = False
        self._emit(
            "step_end", version=report.policy_version, groups=report.group_ids, staleness=report.staleness
        )
        return report

    # --- all in this process ---------------------------------------------------------------------------------

    def accumulate(self, satellites: Sequence[CellWorker] = (), join_after: int = 0) -> list[torch.Tensor]:
        """Run one batch to the end of accumulation; returns the joined satellites' flat gradients.

        Satellites join serially (by index) once the core has processed ``join_after`` items; a joining satellite
        loads the core's weight snapshot (fixed during accumulation). Items are claimed round-robin.
        """
        self.open_batch()
        joined: list[CellWorker] = []
        done_by_core = 0
        while not self.queue.finished:
            if len(joined) < len(satellites) and done_by_core >= join_after:
                sat = satellites[len(joined)]
                sat.backend.zero_grad()
                sat.backend.load_flat_params(self.core.backend.flat_params())  # the weight snapshot
                joined.append(sat)
            progressed = False
            for worker in [self.core, *joined]:
                if self.run_one(worker):
                    progressed = True
                    done_by_core += worker is self.core
            if not progressed and not self.queue.finished:
                if self.starving:
                    raise DataStarvation(
                        f"batch {self.version} needs more ready groups than the buffer holds"
                    )
                raise RuntimeError(f"batch {self.version}: no claimable work although groups are available")
        grads = [s.backend.flat_grads() for s in joined]
        for s in joined:
            s.backend.zero_grad()
        return grads

    def step(
        self, satellites: Sequence[CellWorker] = (), join_after: int = 0, dump_dir: str | Path | None = None
    ) -> StepReport:
        """One optimizer step in this process (core + in-process satellites, see ``accumulate``)."""
        return self.finish(self.accumulate(satellites, join_after), dump_dir=dump_dir)
