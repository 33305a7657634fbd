"""One continuous 1F1B pipeline per cell over the micro-steps it claims (DESIGN §7.1, paper §4.4).

A cell with PP stages (x TP x DP ranks) trains the micro-steps it claims as they arrive, without knowing how many a
batch holds: stage s keeps ``PP - 1 - s`` forwards in flight (the 1F1B warm-up depth) and, once that deep, runs one
backward per forward. The cell therefore pays one fill (warm-up) and one drain (cool-down) per batch instead of one
per micro-step (:meth:`StreamingPipeline.run_batch` with ``mode="per_microstep"`` is the old way: one
``get_forward_backward_func()`` call per micro-step, a fill and a drain each).

**Control plane.** The cell's leader (rank 0 of the cell) claims work and appends one token per decision to an
ordered stream that every other rank of the cell reads (:class:`ControlChannel`, a ``torch.distributed.TCPStore``
hosted by the leader; the leader never waits for readers). Tokens:

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

import datetime
import json
import os
import queue as queue_mod
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from gyre_train.backends.base import PackedTensors
from gyre_train.loss import LossConfig, make_loss_fn, prepass_partials
from gyre_train.megatron.backend import MegatronBackend
from gyre_train.queue import MicroStepQueue
from gyre_train.types import ExecutionPartial, PrepassResult, TokenStats, TrainResult, WorkItem

from megatron.core import parallel_state  # isort: skip  (after gyre_train.megatron.model applied compat)
from megatron.core.pipeline_parallel import get_forward_backward_func, schedules  # isort: skip
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # isort: skip

__all__ = [
    "ControlChannel",
    "PipelineStats",
    "QueueSource",
    "StreamingPipeline",
    "WorkSource",
]

Mode = Literal["continuous", "per_microstep"]
_SHAPES = [()]  # variable_seq_lengths: megatron exchanges each tensor's shape before the tensor


@dataclass(slots=True)
class PipelineStats:
    """What one rank's pipeline did over a batch (every rank of a cell counts the same, except ``waited_s``)."""

    microsteps: int = 0
    """Train items (forward + backward)."""
    forward_only: int = 0
    """Pre-pass items (forward only, at a consistent point)."""
    fills: int = 0
    """Times the pipeline started from empty (a warm-up)."""
    drains: int = 0
    """Times it ran its cool-down to empty."""
    pauses: int = 0
    """Times it stopped with work in flight, state kept, because nothing was claimable."""
    resumes: int = 0
    """Times a train item continued a paused pipeline."""
    starved_waits: int = 0
    """Leader only: idle spells in which only new data could give the cell work (data late), as opposed to
    waiting for outstanding pre-pass results."""

    def add(self, other: PipelineStats) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


# --- work sources -----------------------------------------------------------------------------------------------


class WorkSource(Protocol):
    """Where a pipelined cell's leader gets work and reports results (the shared queue seen by one cell)."""

    cell: int

    def claim(self) -> WorkItem | None:
        """One item for this cell, or None if nothing is claimable now."""
        ...

    def report(self, result: PrepassResult | TrainResult) -> None: ...

    def exhausted(self) -> bool:
        """The stream is closed and nothing more will ever be claimable by this cell in this batch: drain."""
        ...

    def starved(self) -> bool:
        """Nothing is claimable and only new data (not outstanding results) can change that."""
        ...

    @property
    def changes(self) -> int:
        """A counter that moves whenever claimability may have changed (put, close, report)."""
        ...

    def wait(self, since: int, timeout: float) -> None:
        """Return once ``changes != since`` (or after ``timeout`` seconds)."""
        ...


class QueueSource:
    """A :class:`~gyre_train.queue.MicroStepQueue` fed by another thread (``put`` / ``close``) and claimed by one
    pipelined cell; tracks the cell's own claims to know when the batch is exhausted for it."""

    def __init__(self, microsteps: MicroStepQueue, cell: int = 0) -> None:
        self.queue = microsteps
        self.cell = cell
        self._cond = threading.Condition()
        self._changes = 0
        self._closed = False
        self._train: set[int] = set()  # this cell's claimed train items not yet reported
        self._prepass: set[int] = set()

    def _bump(self) -> None:
        self._changes += 1
        self._cond.notify_all()

    def put(self, microstep) -> None:
        with self._cond:
            self.queue.put(microstep)
            self._bump()

    def close(self) -> None:
        with self._cond:
            self.queue.close()
            self._closed = True
            self._bump()

    def claim(self) -> WorkItem | None:
        with self._cond:
            item = self.queue.claim(self.cell)
            if item is not None:
                (self._train if item.kind == "train" else self._prepass).add(item.microstep.index)
            return item

    def report(self, result: PrepassResult | TrainResult) -> None:
        with self._cond:
            if isinstance(result, PrepassResult):
                self.queue.report_prepass(result)
                self._prepass.discard(result.index)
            else:
                self.queue.report_train(result)
                self._train.discard(result.index)
            self._bump()

    def exhausted(self) -> bool:
        """Closed, nothing unclaimed, no own pre-pass outstanding, every unfinished micro-step an own train item."""
        with self._cond:
            q = self.queue
            return (
                self._closed and q.unclaimed == 0 and not self._prepass and q.outstanding == len(self._train)
            )

    def starved(self) -> bool:
        """Open, nothing unclaimed, no own pre-pass outstanding: items waiting for a pre-pass wait for micro-steps
        not put yet (this source is the queue's only cell)."""
        with self._cond:
            return not self._closed and self.queue.unclaimed == 0 and not self._prepass

    @property
    def changes(self) -> int:
        with self._cond:
            return self._changes

    def wait(self, since: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._changes != since, timeout=timeout)


# --- control plane ----------------------------------------------------------------------------------------------


class ControlChannel:
    """The cell's token stream and result mailbox in a ``torch.distributed.TCPStore`` hosted by the leader.

    Tokens are keys ``t/<seq>`` (seq counts across batches); the last stage of data-parallel pipeline d posts
    ``r/<seq>/<d>``. Readers acknowledge each batch (``ack/<drain seq>``) and the leader deletes the batch's keys
    once all have. Every thread uses its own store client (``client()``).
    """

    def __init__(self, host: str, port: int, *, rank: int, world: int, timeout_s: float = 3600.0) -> None:
        self.host, self.port, self.rank, self.world = host, port, rank, world
        self.timeout_s = timeout_s
        self._master: Any = None
        if rank == 0:
            self._master = self._store(is_master=True)
            self.port = self._master.port
        self.store = self._store(is_master=False)
        self.seq = 0
        """Next token's sequence number; counts across batches and across the pipelines that use this channel."""
        self._acked: list[tuple[int, int]] = []  # leader: (first seq, drain seq) of batches to delete

    def _store(self, *, is_master: bool) -> Any:
        return dist.TCPStore(
            self.host, self.port, is_master=is_master, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )  # fmt: skip

    @classmethod
    def create(cls, group: Any = None, host: str | None = None, timeout_s: float = 3600.0) -> ControlChannel:
        """Collective over ``group`` (default: the whole world = the cell): its rank 0 hosts the store on a free
        port and broadcasts the address."""
        host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        chan = cls(host, 0, rank=0, world=world, timeout_s=timeout_s) if rank == 0 else None
        box = [(chan.host, chan.port) if chan is not None else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)  # fmt: skip
        if chan is None:
            chan = cls(box[0][0], box[0][1], rank=rank, world=world, timeout_s=timeout_s)
        return chan

    def client(self) -> Any:
        return self._store(is_master=False)

    def _get(self, store: Any, key: str) -> bytes:
        """Block until ``key`` exists (a reader may wait through a long pause), at most ``timeout_s``."""
        try:
            return store.get(key)
        except dist.DistStoreError as exc:
            raise TimeoutError(f"control channel: no {key!r} within {self.timeout_s:.0f} s") from exc

    def publish(self, seq: int, token: dict) -> None:
        self.store.set(f"t/{seq}", json.dumps(token))

    def read(self, seq: int) -> dict:
        return json.loads(self._get(self.store, f"t/{seq}"))

    def post_result(self, seq: int, dp: int, payload: dict) -> None:
        self.store.set(f"r/{seq}/{dp}", json.dumps(payload))

    def take_result(self, store: Any, seq: int, dp: int) -> dict:
        key = f"r/{seq}/{dp}"
        out = json.loads(self._get(store, key))
        store.delete_key(key)
        return out

    def ack(self, drain_seq: int) -> None:
        self.store.add(f"ack/{drain_seq}", 1)

    def retire(self, first: int, drain_seq: int) -> None:
        """Leader: delete the tokens of batch [first, drain_seq] once every reader acknowledged it."""
        self._acked.append((first, drain_seq))
        keep = []
        for a, d in self._acked:
            if self.store.add(f"ack/{d}", 0) >= self.world - 1:
                for s in range(a, d + 1):
                    self.store.delete_key(f"t/{s}")
                self.store.delete_key(f"ack/{d}")
            else:
                keep.append((a, d))
        self._acked = keep


# --- the schedule -----------------------------------------------------------------------------------------------


@dataclass
class _StageState:
    """One stage's 1F1B state, kept across pauses (never across drains)."""

    outstanding: deque = field(default_factory=deque)  # (input tensors, output tensors) awaiting backward
    pending_dx: list | None = None  # input grads of the last backward, not yet sent upstream
    stash: deque = field(
        default_factory=deque
    )  # output grads received at a pause, for the oldest outstanding
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
        self._begin()
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
        return self._end()

    def _emit(self, token: dict) -> None:
        """Publish first (readers may need it to complete this rank's own communication), then apply."""
        seq = self.channel.seq
        self.channel.publish(seq, token)
        self.channel.seq += 1
        self._apply(token, seq)

    # --- other ranks ----------------------------------------------------------------------------------------------

    def follow_batch(self) -> PipelineStats:
        """Apply the leader's tokens until the batch's drain; returns the batch's counts."""
        if self.is_leader:
            raise RuntimeError("the leader runs run_batch")
        self._begin()
        while True:
            seq = self.channel.seq
            token = self.channel.read(seq)
            self.channel.seq += 1
            self._apply(token, seq)
            if token["kind"] == "drain":
                self.channel.ack(seq)
                return self._end()

    # --- shared -------------------------------------------------------------------------------------------------

    def _begin(self) -> None:
        self.stats = PipelineStats()
        self._state = _StageState()
        self._partial_before = self.backend.partial_grads_before()

    def _end(self) -> PipelineStats:
        self.backend.sum_partial_grads(self._partial_before)  # fp32 path: TP / tied-embedding partial grads
        self._partial_before = None
        self.totals.add(self.stats)
        return self.stats

    def _apply(self, token: dict, seq: int) -> None:
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
            out.update(kind="train", stats=stats.model_dump(mode="json"),
                       partials=[p.model_dump(mode="json") for p in loss_fn.partials])  # fmt: skip
            return loss, one, {}

        def forward_step_func(data_iterator, model):
            return model(**prep.kwargs), loss_func

        output, _ = schedules.forward_step(
            forward_step_func, None, self.backend.chunk, 1, input_tensor, [], self.config, self._cp_size,
            is_first_microbatch=False, current_microbatch=None, is_last_stage=self.last,
        )  # fmt: skip
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
            out.update(kind="train", stats=stats.model_dump(mode="json"),
                       partials=[p.model_dump(mode="json") for p in loss_fn.partials])  # fmt: skip
            return loss, torch.tensor(1, dtype=torch.int), {}

        def forward_step_func(data_iterator, model):
            return model(**prep.kwargs), loss_func

        self.chunk_train()
        get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=iter([None]), model=[self.backend.chunk],
            num_microbatches=1, seq_length=packed.num_tokens, micro_batch_size=1, forward_only=False,
        )  # fmt: skip
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
                self.source.report(_combine(item, parts, self.source.cell))
        except BaseException as exc:  # surfaced by check()/finish() in the leader's thread
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("pipeline result collection failed") from self.error

    def finish(self) -> None:
        self._items.put(None)
        self.join()
        self.check()


def _combine(item: WorkItem, parts: list[dict], cell: int) -> PrepassResult | TrainResult:
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
