"""One continuous 1F1B pipeline per cell over the micro-steps it claims (docs/design/training.md#buffers, paper §4.4).

A cell with PP stages (x TP x DP ranks) trains the micro-steps it claims as they arrive, without knowing how many a
batch holds: stage s keeps ``PP - 1 - s`` forwards in flight (the 1F1B warm-up depth) and, once that deep, runs one
backward per forward. The cell therefore pays one fill (warm-up) and one drain (cool-down) per batch instead of one
per micro-step (:meth:`StreamingPipeline.run_batch` with ``mode="per_microstep"`` is the old way: one
``get_forward_backward_func()`` call per micro-step, a fill and a drain each).

**Control plane.** The cell's leader (rank 0 of the cell) claims work and appends one token per decision to an
ordered stream that every other rank of the cell reads (:class:`ControlChannel`, a ``torch.distributed.TCPStore``
hosted by the leader, :mod:`gyre_train.megatron.control`; the leader never waits for readers). Tokens:

- ``item``: a claimed :class:`~gyre_train.types.WorkItem` (the whole micro-step; each data-parallel pipeline runs
  ``shards[dp_rank]``). A ``train`` item is one forward (and, once the stage is warmed up, one backward) of the
  1F1B; a ``prepass`` item is a forward-only pass run at a consistent point (see pause) so that its per-execution
  partial sums come back quickly.
- ``pause``: the queue has nothing for this cell but the stream is open (data is late, or pre-pass results are
  outstanding). Every stage completes its in-flight communication -- a stage holding the input gradient of its
  last backward sends it upstream, and the stage above receives it and keeps it -- and waits for the next token
  with its outstanding forwards (activations) kept: the pipeline is not drained. The next ``item`` resumes the
  1F1B where it stopped (a stage that kept a received gradient uses it instead of receiving one).
- ``drain``: the stream is closed and nothing more will be claimable by this cell; stages run their cool-down
  backwards and the pipeline is empty (``PipelineStats.drains``). The batch's gradients are complete when every
  rank has processed it.

All stages see the same tokens in the same order, so they pause, resume and drain at the same scheduling point.
The computation order of a stage is exactly the order of an uninterrupted 1F1B over the same micro-steps, so
pauses change nothing numerically.

**Data plane.** Activations and gradients move with megatron's ``P2PCommunicator`` (``variable_seq_lengths``: shapes
are exchanged first), with megatron's pairing -- ``send_forward_recv_backward`` on a stage matched by
``send_backward_recv_forward`` on the next -- in the steady state, and plain sends/receives in warm-up, cool-down
and at pauses, so the same code runs on gloo (CPU) and NCCL (GPU). Forward and backward steps are megatron's
``schedules.forward_step`` / ``backward_step``.

**Results.** The last stage of each data-parallel pipeline computes the loss (``gyre_train.loss``; the loss is
pre-scaled per token, ``calculate_per_token_loss=True`` so nothing divides it) and posts the item's TokenStats and
partial sums; the leader's collector thread sums them over data-parallel ranks and reports them to its
:class:`WorkSource` (the shared queue), as ``CellWorker`` does for a one-process cell.
"""

from __future__ import annotations

import queue as queue_mod
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from gyre_train.backends.base import PackedTensors
from gyre_train.loss import LossConfig, make_loss_fn, prepass_partials
from gyre_train.megatron.backend import MegatronBackend
from gyre_train.megatron.control import ControlChannel
from gyre_train.megatron.sources import PipelineStats, QueueSource, WorkSource
from gyre_train.types import ExecutionPartial, PrepassResult, TokenStats, TrainResult, WorkItem

from megatron.core import parallel_state  # isort: skip  (after gyre_train.megatron.model applied compat)
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules  # isort: skip
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # isort: skip

__all__ = [
    "ControlChannel",  # re-exported: the channel and the sources live in their own modules
    "PipelineStats",
    "QueueSource",
    "StreamingPipeline",
    "WorkSource",
]

Mode = Literal["continuous", "per_microstep"]
_SHAPES = [()]  # variable_seq_lengths: megatron exchanges each tensor's shape before the tensor


# --- the schedule -----------------------------------------------------------------------------------------------


@dataclass
class _StageState:
    """One stage's 1F1B state, kept across pauses (never across drains)."""

    outstanding: deque = field(default_factory=deque)  # (input tensors, output tensors) awaiting backward
    pending_dx: list | None = None  # input grads of the last backward, not yet sent upstream
    # output grads received at a pause, for the oldest outstanding
    stash: deque = field(default_factory=deque)
    next_x: list | None = None  # input of the next forward, received with the fused steady-state exchange
    forwards: int = 0  # forwards since the pipeline was last empty
    paused: bool = False


class StreamingPipeline:
    """The continuous 1F1B of one rank of a pipelined cell (module docstring). Every rank of the cell builds one
    over its :class:`~gyre_train.megatron.backend.MegatronBackend` and the cell's :class:`ControlChannel`; the
    leader (cell rank 0) calls :meth:`run_batch`, every other rank :meth:`follow_batch`, for each batch."""

    def __init__(
        self,
        backend: MegatronBackend,
        channel: ControlChannel,
        loss: LossConfig,
        *,
        mode: Mode = "continuous",
        poll_s: float = 1.0,
    ) -> None:
        if mode not in ("continuous", "per_microstep"):
            raise ValueError(f"mode must be 'continuous' or 'per_microstep', not {mode!r}")
        self.backend, self.channel, self.loss, self.mode = backend, channel, loss, mode
        self.poll_s = poll_s
        self.config = backend.model.config
        self.p2p = P2PCommunicator(
            pp_group=parallel_state.get_pipeline_model_parallel_group(), config=self.config
        )
        self.first, self.last = self.p2p.is_pp_first_stage, self.p2p.is_pp_last_stage
        self.warmup = self.p2p.total_stages - self.p2p.current_stage - 1
        self.dp_rank, self.dp_size = backend.dp_rank, backend.dp_size
        self.posts_results = (
            self.last
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
        )
        self.is_leader = channel.rank == 0
        self._cp_size = parallel_state.get_context_parallel_world_size()
        self._state = _StageState()
        self._partial_before: list | None = None
        self.stats = PipelineStats()
        """This batch's counts (reset at each batch)."""
        self.totals = PipelineStats()
        """Counts over every batch so far."""

    # --- leader -------------------------------------------------------------------------------------------------

    def run_batch(self, source: WorkSource, on_idle: Callable[[str], None] | None = None) -> PipelineStats:
        """Claim and train until the batch is exhausted for this cell, then drain; returns the batch's counts.

        When nothing is claimable the leader tells every stage to pause (once per idle spell) and waits for the
        source to change. ``on_idle(reason)`` is called when a spell starts and whenever its reason changes:
        ``"waiting"`` (outstanding pre-pass results may release items) or ``"starved"`` (only new data can:
        ``PipelineStats.starved_waits`` counts these). Results are reported to ``source`` as the last stages post
        them; when this returns, all are reported.
        """
        if not self.is_leader:
            raise RuntimeError("run_batch is the leader's (cell rank 0); other ranks call follow_batch")
        self.begin_batch()
        first_seq = self.channel.seq
        collector = _Collector(self, source)
        collector.start()
        idle: str | None = None
        try:
            while True:
                since = source.changes
                item = source.claim()
                if item is not None:
                    idle = None
                    collector.expect(self.channel.seq, item)
                    self._emit({"kind": "item", "item": item.model_dump(mode="json")})
                    continue
                collector.check()
                if source.exhausted():
                    break
                if not self._state.paused:
                    self._emit({"kind": "pause"})
                reason = "starved" if source.starved() else "waiting"
                if reason != idle:
                    idle = reason
                    self.stats.starved_waits += reason == "starved"
                    if on_idle is not None:
                        on_idle(reason)
                source.wait(since, self.poll_s)
            drain_seq = self.channel.seq
            self._emit({"kind": "drain"})
        finally:
            collector.finish()
        self.channel.retire(first_seq, drain_seq)
        return self.end_batch()

    def _emit(self, token: dict) -> None:
        """Publish first (readers may need it to complete this rank's own communication), then apply."""
        seq = self.channel.seq
        self.channel.publish(seq, token)
        self.channel.seq += 1
        self.apply(token, seq)

    # --- other ranks ----------------------------------------------------------------------------------------------

    def follow_batch(self) -> PipelineStats:
        """Apply the leader's tokens until the batch's drain; returns the batch's counts."""
        if self.is_leader:
            raise RuntimeError("the leader runs run_batch")
        self.begin_batch()
        while True:
            seq = self.channel.seq
            token = self.channel.read(seq)
            self.channel.seq += 1
            self.apply(token, seq)
            if token["kind"] == "drain":
                self.channel.ack(seq)
                return self.end_batch()

    # --- shared -------------------------------------------------------------------------------------------------

    def begin_batch(self) -> None:
        self.stats = PipelineStats()
        self._state = _StageState()
        self._partial_before = self.backend.partial_grads_before()

    def end_batch(self) -> PipelineStats:
        self.backend.sum_partial_grads(self._partial_before)  # fp32 path: TP / tied-embedding partial grads
        self._partial_before = None
        self.totals.add(self.stats)
        return self.stats

    def apply(self, token: dict, seq: int) -> None:
        kind = token["kind"]
        if kind == "item":
            item = WorkItem.model_validate(token["item"])
            if item.kind == "train":
                self._settle_for_forward()
                out = self._train(item) if self.mode == "continuous" else self._train_alone(item)
            else:
                self._quiesce()
                out = self._forward_only(item)
            if self.posts_results:
                self.channel.post_result(seq, self.dp_rank, out)
        elif kind == "pause":
            self._quiesce()
            if not self._state.paused:
                self._state.paused = True
                self.stats.pauses += 1
        elif kind == "drain":
            self._drain()
        else:
            raise ValueError(f"unknown control token {kind!r}")

    # --- 1F1B pieces --------------------------------------------------------------------------------------------

    def _settle_for_forward(self) -> None:
        """Before a train forward: the pending input grad goes upstream fused with receiving this forward's input
        (megatron's steady-state send_backward_recv_forward), matched by the upstream stage's
        send_forward_recv_backward."""
        st = self._state
        if st.paused:
            st.paused = False
            self.stats.resumes += 1
        if self.mode != "continuous" or st.pending_dx is None:
            return
        st.next_x = self.p2p.send_backward_recv_forward(st.pending_dx, _SHAPES, self.first)
        st.pending_dx = None

    def _quiesce(self) -> None:
        """Complete in-flight communication, keep state: send the pending input grad upstream (plain) and
        receive, and keep, the output grad the stage below sent at this same point."""
        st = self._state
        if self.mode != "continuous":
            return
        if st.pending_dx is not None:
            self.p2p.send_backward(st.pending_dx, self.first)
            st.pending_dx = None
        # The stage below did a backward in its last forward iff this stage has done >= warmup forwards; its input
        # grad is for this stage's oldest outstanding forward. Received once (a second pause finds it stashed).
        if not self.last and st.forwards >= self.warmup and not st.stash and st.outstanding:
            st.stash.append(self.p2p.recv_backward(_SHAPES, self.last))

    def _train(self, item: WorkItem) -> dict:
        st = self._state
        if st.forwards == 0 and not st.outstanding:
            self.stats.fills += 1
        x = st.next_x if st.next_x is not None else self.p2p.recv_forward(_SHAPES, self.first)
        st.next_x = None
        self.chunk_train()
        y, out = self._forward(item, x, train=True)
        st.outstanding.append((x, y))
        st.forwards += 1
        self.stats.microsteps += 1
        if len(st.outstanding) <= self.warmup:  # warm-up: forward only
            self.p2p.send_forward(y, self.last)
            return out
        if st.stash:  # the backward's grad came at a pause
            self.p2p.send_forward(y, self.last)
            g = st.stash.popleft()
        else:
            g = self.p2p.send_forward_recv_backward(y, _SHAPES, self.last)
        x0, y0 = st.outstanding.popleft()
        st.pending_dx = schedules.backward_step(x0, y0, g, self.config)
        return out

    def _drain(self) -> None:
        st = self._state
        if self.mode == "continuous":
            if st.pending_dx is not None:
                self.p2p.send_backward(st.pending_dx, self.first)
                st.pending_dx = None
            while st.outstanding:
                g = st.stash.popleft() if st.stash else self.p2p.recv_backward(_SHAPES, self.last)
                x0, y0 = st.outstanding.popleft()
                self.p2p.send_backward(schedules.backward_step(x0, y0, g, self.config), self.first)
            if st.forwards:
                self.stats.drains += 1
        self._state = _StageState()

    def chunk_train(self) -> None:
        self.backend.chunk.train()

    def _forward(self, item: WorkItem, input_tensor: list, *, train: bool) -> tuple[list, dict]:
        """megatron's forward_step on this stage for this rank's shard; on the last stage also the loss (train) or
        the log-probs' partial sums (pre-pass). Returns (output tensors, result payload)."""
        ms = item.microstep
        shard = ms.shards[self.dp_rank]
        prep = self.backend._inputs(PackedTensors.from_shard(shard))
        out: dict = {}

        def loss_func(output: torch.Tensor):
            l_T = self.backend.shard_logprobs(output, prep, ms.temperature)
            one = torch.tensor(1, dtype=torch.int)
            if not train:
                sums, counts = prepass_partials(shard, l_T.detach().cpu(), len(ms.executions))
                out.update(kind="prepass", sums=sums, counts=counts)
                return l_T.sum() * 0.0, one, {}
            loss_fn = make_loss_fn(ms, self.dp_rank, self.loss, dtype=torch.float64)
            loss, stats = loss_fn(l_T.cpu())
            out.update(
                kind="train",
                stats=stats.model_dump(mode="json"),
                partials=[p.model_dump(mode="json") for p in loss_fn.partials],
            )
            return loss, one, {}

        def forward_step_func(data_iterator, model):
            return model(**prep.kwargs), loss_func

        output, _ = schedules.forward_step(
            forward_step_func,
            None,
            self.backend.chunk,
            1,
            input_tensor,
            [],
            self.config,
            self._cp_size,
            is_first_microbatch=False,
            current_microbatch=None,
            is_last_stage=self.last,
        )
        return output, out

    def _forward_only(self, item: WorkItem) -> dict:
        """A pre-pass item at a consistent point (after ``_quiesce``): plain receive, forward without grad, send."""
        self.stats.forward_only += 1
        with torch.no_grad():
            x = self.p2p.recv_forward(_SHAPES, self.first)
            y, out = self._forward(item, x, train=False)
            self.p2p.send_forward(y, self.last)
        return out

    def _train_alone(self, item: WorkItem) -> dict:
        """``per_microstep`` mode: one megatron schedule call per micro-step (a fill and a drain each)."""
        ms = item.microstep
        packed = PackedTensors.from_shard(ms.shards[self.dp_rank])
        prep = self.backend._inputs(packed)
        out: dict = {}

        def loss_func(output: torch.Tensor):
            l_T = self.backend.shard_logprobs(output, prep, ms.temperature)
            loss_fn = make_loss_fn(ms, self.dp_rank, self.loss, dtype=torch.float64)
            loss, stats = loss_fn(l_T.cpu())
            out.update(
                kind="train",
                stats=stats.model_dump(mode="json"),
                partials=[p.model_dump(mode="json") for p in loss_fn.partials],
            )
            return loss, torch.tensor(1, dtype=torch.int), {}

        def forward_step_func(data_iterator, model):
            return model(**prep.kwargs), loss_func

        self.chunk_train()
        get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=iter([None]),
            model=[self.backend.chunk],
            num_microbatches=1,
            seq_length=packed.num_tokens,
            micro_batch_size=1,
            forward_only=False,
        )
        self.stats.microsteps += 1
        self.stats.fills += 1
        self.stats.drains += 1
        return out


class _Collector(threading.Thread):
    """Leader: waits for each item's results (one per data-parallel pipeline), sums them, reports to the source."""

    def __init__(self, pipe: StreamingPipeline, source: WorkSource) -> None:
        super().__init__(name="pipeline-results", daemon=True)
        self.pipe, self.source = pipe, source
        self.store = pipe.channel.client()
        self._items: queue_mod.Queue = queue_mod.Queue()
        self.error: BaseException | None = None

    def expect(self, seq: int, item: WorkItem) -> None:
        self._items.put((seq, item))

    def run(self) -> None:
        try:
            while (job := self._items.get()) is not None:
                seq, item = job
                parts = [self.pipe.channel.take_result(self.store, seq, d) for d in range(self.pipe.dp_size)]
                self.source.report(combine_results(item, parts, self.source.cell))
        except BaseException as exc:  # surfaced by check()/finish() in the leader's thread
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("pipeline result collection failed") from self.error

    def finish(self) -> None:
        self._items.put(None)
        self.join()
        self.check()


def combine_results(item: WorkItem, parts: list[dict], cell: int) -> PrepassResult | TrainResult:
    """Sum one item's per-data-parallel-rank results into what ``CellWorker.run`` would return."""
    ms = item.microstep
    if item.kind == "prepass":
        n = len(ms.executions)
        sums, counts = [0.0] * n, [0] * n
        for p in parts:
            sums = [a + b for a, b in zip(sums, p["sums"], strict=True)]
            counts = [a + b for a, b in zip(counts, p["counts"], strict=True)]
        partials = [
            ExecutionPartial(execution_id=e.execution_id, log_ratio_sum=s, count=c)
            for e, s, c in zip(ms.executions, sums, counts, strict=True)
            if c
        ]
        return PrepassResult(batch=ms.batch, index=ms.index, cell=cell, partials=partials)
    stats = TokenStats()
    partials: list[ExecutionPartial] = []
    for p in parts:
        stats = stats + TokenStats.model_validate(p["stats"])
        partials += [ExecutionPartial.model_validate(x) for x in p["partials"]]
    return TrainResult(batch=ms.batch, index=ms.index, cell=cell, stats=stats, partials=partials)
