"""A multi-rank cell inside a multi-cell run: one process per (TP rank, pipeline stage), driven by the cell's leader.

``gyre run`` with ``backend = "megatron"`` and ``tensor_parallel = T``, ``pipeline_parallel = P`` (T * P > 1) gives
each of its K cells T * P processes: the cell worker is its (TP rank 0, stage 0) (the leader: it claims work like any
cell, through the core's shared queue or the coordinator), and T * P - 1 child processes are its other ranks
(:class:`StageFollower`). They share one gloo world of K * T * P ranks laid out in megatron's tp-dp-pp order (rank =
tp + T * (cell + K * stage), :func:`cell_rank`): megatron's model-parallel groups (TP x PP) are the cells, its
"data-parallel" groups one (TP rank, stage) of every cell; the fp32 path never reduces over the latter, the cells'
gradients are summed by the multi-cell reduce. The K - 1 prefix groups of the cells' leaders (ranks 0, T, 2T, ...)
are built by every rank, as group creation is collective. The TP ranks of a stage read the same tokens and run the
same items (megatron's TP layers all-reduce inside the forward and backward); TP rank 0 of the last stage posts the
results.

**One item at a time, one continuous 1F1B.** The leader is handed claimed items one by one (``Trainer.run_one`` on
the core, ``SatelliteRunner`` on a satellite, both alongside the other cells' claims on the same queue): for each it
appends an ``item`` token to the cell's :class:`~gyre_train.megatron.control.ControlChannel`, runs its own stage of
the :class:`~gyre_train.megatron.pipeline.StreamingPipeline` (forward, and the backward of the item ``P - 1``
earlier) and waits for the last stage's result (loss statistics, pre-pass sums), which the last stage posts as soon
as its forward ends -- it never waits for later items, so returning the result per item cannot deadlock. The
pipeline is not drained between items: a cell pays one fill and one drain per batch. It drains before anything
reads or changes the accumulated state (the gradients at the batch end, a snapshot load, the optimizer step).

**Whole-cell backend.** The leader's :class:`PipelinedBackend` is the cell's ``TrainBackend`` to the multi-cell
code: each call is an ``op`` token that every rank applies with the same collective over the cell's model-parallel
group. Flat parameter and gradient vectors are the whole model in Hugging Face parameter order (what a one-process
torch backend holds), so cells exchange them as usual and a dumped batch replays on the torch backend
(``gyre_train.replay``); each stage takes its own tensors from a full vector (``load_hf_weights``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gyre_train.loss import LossConfig
from gyre_train.megatron.backend import MegatronBackend
from gyre_train.megatron.control import ControlChannel
from gyre_train.megatron.model import load_hf_weights
from gyre_train.megatron.pipeline import StreamingPipeline, combine_results
from gyre_train.megatron.weights import write_hf_checkpoint
from gyre_train.multicell import MultiCellConfig, PrefixGroups
from gyre_train.types import PrepassResult, TrainResult, WorkItem
from gyre_train.world import bound_store

from megatron.core import parallel_state  # isort: skip  (after gyre_train.megatron.model applied compat)

__all__ = [
    "PipelinedBackend",
    "PipelinedWorker",
    "StageFollower",
    "cell_position",
    "cell_rank",
    "hf_layout",
    "init_pipelined_cell",
]


def cell_rank(cell: int, stage: int, num_cells: int, tp: int = 0, tensor_parallel: int = 1) -> int:
    """Global rank of a cell's (TP rank, stage): megatron's tp-dp-pp order, TP innermost and pipeline stages
    outermost (rank = tp + T * (dp + DP * pp_rank)); with T = 1, rank = cell + K * stage."""
    return tp + tensor_parallel * (cell + num_cells * stage)


def cell_position(local: int, tensor_parallel: int) -> tuple[int, int]:
    """(TP rank, stage) of a cell's ``local``-th rank, 0 being its leader; TP innermost as in :func:`cell_rank`."""
    return local % tensor_parallel, local // tensor_parallel


def init_pipelined_cell(
    cfg: MultiCellConfig, cell: int, stage: int, pipeline_parallel: int, tp: int = 0, tensor_parallel: int = 1
) -> PrefixGroups:
    """Join the gloo world of K * T * P ranks and build the leaders' prefix groups (every rank, same order; the
    leaders are ranks 0, T, 2T, ...). Build the megatron backend next (its group creation is collective too),
    then :func:`open_channel`."""
    rank = cell_rank(cell, stage, cfg.num_cells, tp, tensor_parallel)
    size = cfg.num_cells * tensor_parallel * pipeline_parallel
    # the store listens on the core's address only (torch's own would listen on every interface)
    store = bound_store(cfg.host, cfg.master_port, size, is_master=rank == 0, timeout=dist.default_pg_timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return PrefixGroups(cfg.num_cells, timeout=cfg.collective_timeout(), stride=tensor_parallel)


def open_channel(host: str) -> ControlChannel:
    """The cell's control channel over its model-parallel group (TP x PP: every rank of the cell; collective)."""
    return ControlChannel.create(group=parallel_state.get_model_parallel_group(), host=host)


def hf_layout(model_path: str) -> list[tuple[str, torch.Size]]:
    """(name, shape) of the HF model's parameters in ``named_parameters`` order: the order of a one-process torch
    backend's flat vectors (tied weights once). Built on the meta device: no memory, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(n, p.shape) for n, p in model.named_parameters()]


class _Stage:
    """What every stage of the cell does for a token; the leader emits tokens, followers read them."""

    def __init__(
        self,
        backend: MegatronBackend,
        channel: ControlChannel,
        loss: LossConfig,
        *,
        cell: int,
        stats_path: str | Path | None = None,
        hooks: dict[str, Callable[[], None]] | None = None,
    ) -> None:
        self.backend, self.channel, self.cell = backend, channel, cell
        self.pipe = StreamingPipeline(backend, channel, loss)
        # The cell is one pipeline: its micro-steps have one shard (megatron's "data-parallel" groups span cells).
        self.pipe.dp_rank, self.pipe.dp_size = 0, 1
        self.group = parallel_state.get_model_parallel_group()  # every rank of the cell (TP x PP)
        self.leader_rank = dist.get_global_rank(self.group, 0)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.layout = hf_layout(backend.cfg.model_path)
        self.numel = sum(s.numel() for _, s in self.layout)
        self.stats_path = Path(stats_path) if stats_path is not None else None
        self.hooks = hooks or {}
        self.active = False  # items applied since the last drain
        self._first_seq = 0  # first token not yet retired (leader) / acknowledged (followers)

    # --- pipeline tokens ----------------------------------------------------------------------------------------

    def item(self, token: dict, seq: int) -> None:
        if not self.active:
            self.pipe.begin_batch()
            self.active = True
        self.pipe.apply(token, seq)

    def drain(self, token: dict, seq: int) -> None:
        self.pipe.apply(token, seq)
        stats = self.pipe.end_batch()
        self.active = False
        if self.stats_path is not None:
            row = {
                "cell": self.cell,
                "stage": self.stage,
                "tp": self.tp_rank,
                "pid": os.getpid(),
                **asdict(stats),
            }
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.stats_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    # --- operations on the whole cell ---------------------------------------------------------------------------

    def op(self, name: str, args: dict, payload: Any = None) -> Any:
        """This stage's part of operation ``name``; on the leader returns the whole cell's answer."""
        b, group, leader = self.backend, self.group, self.leader_rank
        is_leader = dist.get_rank() == leader
        if name in ("flat_grads", "flat_params", "hf_state_dict", "state_dict"):
            mine = {
                "flat_grads": lambda: b.export_hf_grads(),
                "flat_params": lambda: b.export_hf_weights(),
                "hf_state_dict": lambda: b.export_hf_weights(),
                "state_dict": lambda: b.state_dict(),
            }[name]()
            if self.tp_rank != 0 and name != "state_dict":
                mine = {}  # every TP rank gathered the same full tensors: TP rank 0 of each stage sends them
            parts: list | None = [None] * dist.get_world_size(group) if is_leader else None
            dist.gather_object(mine, parts, dst=leader, group=group)
            if not is_leader:
                return None
            if name == "state_dict":
                return {"pipeline_stages": parts}  # one state per rank of the cell, in its group's order
            merged = {k: v for part in parts for k, v in part.items()}
            if name == "hf_state_dict":
                return merged
            return torch.cat([merged[n].reshape(-1).float() for n, _ in self.layout])
        if name in ("set_flat_grads", "load_flat_params"):
            flat = payload.detach().float().contiguous() if is_leader else torch.empty(self.numel)
            dist.broadcast(flat, src=leader, group=group)
            parts = torch.split(flat, [s.numel() for _, s in self.layout])
            full = {n: t.view(s) for (n, s), t in zip(self.layout, parts, strict=True)}
            load_hf_weights(b.model, b.shape, full, grads=name == "set_flat_grads")
            return None
        if name == "load_state_dict":
            box: list = [None]
            parts = payload["pipeline_stages"] if is_leader else None
            if is_leader and len(parts) != dist.get_world_size(group):
                raise ValueError(
                    f"the checkpoint holds {len(parts)} rank states, this cell has "
                    f"{dist.get_world_size(group)} ranks (TP x PP): resume with the layout that saved it"
                )  # the other ranks would wait in the scatter: this error ends the cell, which the run sees
            dist.scatter_object_list(box, parts, src=leader, group=group)
            b.load_state_dict(box[0])
            return None
        if name == "zero_grad":
            return b.zero_grad()
        if name == "optimizer_step":
            return b.optimizer_step(args["max_grad_norm"])
        if name in self.hooks:
            return self.hooks[name]()
        raise ValueError(f"unknown cell operation {name!r}")


class PipelinedBackend:
    """The leader's view of its whole cell as a ``TrainBackend`` (module docstring). Thread-safe: the step or burst
    thread and the worker's HTTP threads (publication, role switches) take turns; every call keeps the stages in
    step because they apply the same tokens in the same order."""

    def __init__(
        self,
        backend: MegatronBackend,
        channel: ControlChannel,
        loss: LossConfig,
        *,
        cell: int,
        stats_path: str | Path | None = None,
        hooks: dict[str, Callable[[], None]] | None = None,
    ) -> None:
        if channel.rank != 0:
            raise RuntimeError("the cell's leader is its stage 0 (channel rank 0)")
        self.stage = _Stage(backend, channel, loss, cell=cell, stats_path=stats_path, hooks=hooks)
        self.stage_backend = backend
        self.cell = cell
        self._lock = threading.RLock()
        self._results = channel.client()

    # What gyre-cell's training state offloads on this process (stage 0's tensors; the stages offload their own
    # on the ``offload`` operation).
    @property
    def model(self) -> torch.nn.Module:
        return self.stage_backend.model

    @property
    def optimizer(self) -> Any:
        return self.stage_backend.optimizer

    @property
    def stats(self):
        """Counts of the stage-0 pipeline over every drained batch (``PipelineStats``)."""
        return self.stage.pipe.totals

    def _emit(self, token: dict) -> int:
        chan = self.stage.channel
        seq = chan.seq
        chan.publish(seq, token)
        chan.seq += 1
        return seq

    def drain(self) -> None:
        """Run the pipeline's cool-down if items went in since the last drain (every stage, same point)."""
        with self._lock:
            if not self.stage.active:
                return
            seq = self._emit({"kind": "drain"})
            self.stage.drain({"kind": "drain"}, seq)
            self.stage.channel.retire(self.stage._first_seq, seq)
            self.stage._first_seq = seq + 1

    def call(self, name: str, payload: Any = None, **args: Any) -> Any:
        """Operation ``name`` on every stage (after a drain); the cell's answer."""
        with self._lock:
            self.drain()
            self._emit({"kind": "op", "op": name, "args": args})
            return self.stage.op(name, args, payload)

    def run_item(self, item: WorkItem) -> PrepassResult | TrainResult:
        """One claimed item through the continuous pipeline; its result once the last stage has it."""
        with self._lock:
            token = {"kind": "item", "item": item.model_dump(mode="json")}
            seq = self._emit(token)
            self.stage.item(token, seq)
            part = self.stage.channel.take_result(self._results, seq, 0)
        return combine_results(item, [part], self.cell)

    def stop(self) -> None:
        """End the followers' loops (they exit); the cell can do nothing more."""
        with self._lock:
            self.drain()
            self._emit({"kind": "stop"})

    # --- TrainBackend ---------------------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self.call("zero_grad")

    def flat_grads(self) -> torch.Tensor:
        return self.call("flat_grads")

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        self.call("set_flat_grads", flat)

    def flat_params(self) -> torch.Tensor:
        return self.call("flat_params")

    def load_flat_params(self, flat: torch.Tensor) -> None:
        self.call("load_flat_params", flat)

    def optimizer_step(self, max_grad_norm: float) -> float:
        return self.call("optimizer_step", max_grad_norm=max_grad_norm)

    def state_dict(self) -> dict[str, Any]:
        return self.call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.call("load_state_dict", state)

    def regroup(self) -> None:
        raise ValueError("a pipelined cell (PP > 1) cannot move to a new world: its stages are one group")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.call("hf_state_dict")

    def save_hf_pretrained(self, out_dir: str | Path) -> None:
        write_hf_checkpoint(self.hf_state_dict(), self.stage_backend.cfg.model_path, out_dir)

    def logprobs(self, *_: Any) -> torch.Tensor:
        raise NotImplementedError("a pipelined cell runs whole work items: PipelinedWorker.run")

    forward_backward = logprobs


class PipelinedWorker:
    """``CellWorker`` of a pipelined cell: ``run(item)`` through the continuous 1F1B (the trainer's and the
    satellite runner's worker; ``backend`` is the whole cell)."""

    def __init__(self, backend: PipelinedBackend) -> None:
        self.backend = backend
        self.cell = backend.cell

    def run(self, item: WorkItem) -> PrepassResult | TrainResult:
        return self.backend.run_item(item)


class StageFollower:
    """A stage other than the leader: applies the cell's tokens in order until ``stop`` (or the leader's death:
    the channel's store goes away and reading raises)."""

    def __init__(
        self,
        backend: MegatronBackend,
        channel: ControlChannel,
        loss: LossConfig,
        *,
        cell: int,
        stats_path: str | Path | None = None,
        hooks: dict[str, Callable[[], None]] | None = None,
    ) -> None:
        if channel.rank == 0:
            raise RuntimeError("the leader drives the cell with PipelinedBackend")
        self.stage = _Stage(backend, channel, loss, cell=cell, stats_path=stats_path, hooks=hooks)

    def serve(self) -> None:
        chan = self.stage.channel
        while True:
            seq = chan.seq
            token = chan.read(seq)
            chan.seq += 1
            kind = token["kind"]
            if kind == "item":
                self.stage.item(token, seq)
            elif kind == "drain":
                self.stage.drain(token, seq)
                chan.ack(seq)
            elif kind == "op":
                self.stage.op(token["op"], token["args"])
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown control token {kind!r}")
