"""Wire types of the cell worker process: its config, the controller's commands and the events it reports.

A cell worker (``gyre_cell.worker``) is one long-lived process per cell. It holds the cell's rollout engine and its
training backend, switches between them in place (docs/design/cells.md) and keeps its process and communication groups alive
across role changes. The controller drives it with the commands below over HTTP (``/cell/...`` next to the engine's
SGLang endpoints on the same port) and reads its events with a long poll. gyre-cell owns these types; the controller
receives them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from gyre_cell.engine.config import EngineConfig
from gyre_cell.errors import CommandRefused
from gyre_cell.sglang_launch import SGLangLaunchConfig
from gyre_cell.stop_gate import StopGate  # re-exported: apart, a run config embeds it without torch
from gyre_cell.switch_report import SwitchReport
from gyre_cell.transfer.mooncake import MooncakeConfig
from gyre_cell.vllm_launch import VLLMLaunchConfig
from gyre_train.loss_config import LossConfig

__all__ = [
    "CellEvent",
    "CellTrainingConfig",
    "CellWorkerConfig",
    "CommandRefused",
    "EventBatch",
    "LoadResult",
    "OpenBatchCommand",
    "PublishCommand",
    "PublishedWeights",
    "SaveCommand",
    "StopGate",
    "SwitchResult",
    "Version",
    "WorkerStatus",
]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    schema_version: Literal[1] = 1


class CellTrainingConfig(_Wire):
    """The training side of an elastic cell (the core builds the trainer; satellites only a backend)."""

    group_size: int = Field(ge=1)
    """N: valid executions per group."""
    batch_groups: int = Field(ge=1)
    """B: groups per optimizer step."""
    steps_per_burst: int = Field(1, ge=1)
    """mu."""
    lr: float = Field(gt=0)
    """Adam learning rate (after the warm-up)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear lr warm-up over the first optimizer steps (0: constant lr)."""
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """Training parameter dtype (float64 only for exactness tests)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Global gradient-norm clip, once per step on the core."""
    tokens_per_shard: int = Field(256, ge=8)
    """Token budget of one micro-step's shard: a batch spans several micro-steps."""
    queue_ahead: int = Field(2, ge=1)
    """Unclaimed micro-steps kept in the shared queue while groups are available."""
    temperature: float = Field(1.0, gt=0)
    """Rollout temperature (log-probs are computed at it)."""
    loss: LossConfig = LossConfig()
    """The GSPO objective (gyre-train's own config: the loss and its metrics read the same one)."""
    master_port: int = Field(ge=1)
    """gloo rendezvous port of the cells' process group (rank = cell index)."""
    coordinator_port: int = Field(ge=1)
    """Port of the core's micro-step coordinator (satellites claim through it)."""
    master_host: str | None = None
    """Address of the core's node: the gloo rendezvous and the micro-step coordinator (None: this worker's
    `host`, right when every cell is on one machine). A launcher placing cells on several hosts sets it."""
    claim_timeout_s: float = Field(300.0, gt=0)
    """Claim lease: a satellite holding one micro-step longer than this is dropped and its work requeued."""
    collective_timeout_s: float = Field(300.0, gt=0)
    """Timeout of the end-of-batch reduce and broadcast between cells (`MultiCellConfig.collective_timeout_s`)."""
    snapshot: Literal["mooncake", "http", "file"] = "mooncake"
    """How joining satellites pull the core's weight snapshot: Mooncake, HTTP from the core (no system library;
    authenticated with the run's engine token), or a file in the run directory (one machine)."""
    dump_batches: list[int] = []
    """Batches whose micro-steps, weights before and summed gradients the core dumps (exactness checks)."""
    hold_core_for_join: int | None = None
    """Test gate: before its second micro-step of a batch the core waits (at most hold_timeout_s) for this
    satellite to join and claim an item, until it has once; makes a mid-batch join that trains certain in short runs."""
    hold_timeout_s: float = Field(30.0, gt=0)
    """How long that wait lasts at most; then the core goes on alone."""
    stop_gate: StopGate | None = None
    """Test gate: a satellite stops itself at one point (`StopGate`)."""
    backend: Literal["torch", "megatron"] = "torch"
    """Training backend (gyre_train.backends.build_backend)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the torch backend trains (the megatron backend follows CUDA availability)."""
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    context_parallel: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)
    """Parallel sizes inside the cell (megatron; 1 for a one-process cell)."""
    checkpoint_keep: int = Field(2, ge=0)
    """The core writes RUN/checkpoints/trainer/step-V (weights, optimizer, HF policy) after every step and keeps the
    last this many (0: only the final save); `gyre run --resume` continues from the newest."""
    resume_from: str | None = None
    """A step checkpoint directory: the core restores its weights, optimizer state and version from it."""


class CellWorkerConfig(_Wire):
    """Everything one cell worker process needs; written by the controller, read once at start."""

    cell: int = Field(ge=0)
    """Elastic cells: the index (0 = core). Standalone engines: their index in the standalone pool."""
    kind: Literal["elastic", "standalone"] = "elastic"
    """Standalone workers serve rollout only: no training side, never switch."""
    num_cells: int = Field(ge=1)
    """K: elastic cells in the run."""
    run_dir: str
    """The run directory (checkpoints/, metrics/ are written under it)."""
    host: str = "127.0.0.1"
    """Bind address of the worker's HTTP server (engine protocol + /cell control)."""
    port: int = Field(ge=1)
    """HTTP port."""
    engine: EngineConfig
    """The in-process torch rollout engine (not built when `sglang` or `vllm` is set)."""
    sglang: SGLangLaunchConfig | None = None
    """Set: rollout runs on an SGLang server this worker starts with the run's engine token (by file), waits for,
    and watches (it exits if the server dies), on `sglang.host:sglang.port`: `WorkerStatus.engine_url`. Published
    weights are pushed to it over HTTP. Its log: RUN/logs/<cell>.sglang.log."""
    vllm: VLLMLaunchConfig | None = None
    """Set: rollout runs on a vLLM server this worker starts (from `vllm.python`, the token by environment), waits
    for until it generates, and watches, on `vllm.host:vllm.port`. Published weights go in by a safetensors file
    loaded in place. Its log: RUN/logs/<cell>.vllm.log."""
    training: CellTrainingConfig | None = None
    """None for standalone workers."""
    weights: Literal["mooncake", "http", "disk"] = "mooncake"
    """How published weights reach rollout engines: pulled over Mooncake, pulled over HTTP from the core (no system
    library; authenticated with the run's engine token), or through a checkpoint on disk."""
    mooncake: MooncakeConfig = MooncakeConfig()
    """Transfer engine settings (TCP on loopback here, RDMA in production)."""
    cpu_threads: int = Field(1, ge=1)
    """torch intra-op threads of this process (training and engine)."""
    visible_gpus: list[str] | None = None
    """Set: the worker exports CUDA_VISIBLE_DEVICES as these ids before anything touches CUDA, so its engine, trainer
    and SGLang server see only its own GPUs (the local launcher; on Ray the actor's GPUs are Ray's to set)."""
    restarted: bool = False
    """An elastic cell started again after its worker died mid-run: it serves rollout at once, but builds no training
    side at start (the run's gloo world is already formed without it); training commands are refused."""


class ReformCommand(_Wire):
    """Re-form the gloo world (a new generation) so a restarted cell trains again; sent to every member cell at a
    burst boundary (gyre_train.multicell.reform_cell_world)."""

    generation: int = Field(strict=True, ge=1, le=2**63 - 1)
    master_port: int = Field(strict=True, ge=1, le=65535)
    """The new generation's rendezvous port on the core's host."""
    rejoining: list[Annotated[int, Field(strict=True, ge=0, le=65535)]] = Field([], max_length=4096)
    """The cells that take their training rank again: restarted ones, and live ones whose world a failed re-form
    left them without (the core's coordinator lets them join batches)."""
    rendezvous_timeout_s: float = Field(120.0, gt=0, le=86400)
    """How long the core waits for all K cells at the new world's rendezvous; past it every waiting cell answers
    503 and has no world until the next re-form (a cell that died or hangs must not hold the others)."""
    members: list[Annotated[int, Field(strict=True, ge=0, le=65535)]] | None = Field(None, max_length=4096)
    """The cells of the new world (rank = position, the core first); None: all K. A cell gone for good (its
    restarts spent) is left out, so it does not block later re-forms."""


class RendezvousPort(_Wire):
    """The core's answer to `/cell/rendezvous_port`: a port free on its rendezvous host for the next gloo world
    generation (only the core's machine can tell which of its ports are free; the controller may run elsewhere)."""

    port: int = Field(ge=1, le=65535)


VERSION_MAX = 2**63 - 1
"""The largest policy version: the weight buffer's header and the engines hold it as an int64 (a larger one was a
500 that left the publish lock held)."""

Version = Annotated[int, Field(strict=True, ge=0, le=VERSION_MAX)]
"""A policy version on the wire: a JSON integer in int64 (strict: `true` or `"1"` are not versions; lax mode took
`true` as 1, and a load then checked the engine's "1" against "True" and answered 500)."""


class PublishedWeights(_Wire):
    """Where a published policy version can be read (the core's answer to a publish, the input of a load)."""

    version: Version
    manifest_url: str | None = Field(None, max_length=4096)
    """Mooncake or HTTP: the core's weight manifest (engines pull the bytes from its published buffer)."""
    path: str | None = Field(None, max_length=4096)
    """Disk: a Hugging Face checkpoint directory."""
    seconds: float = Field(0.0, ge=0)
    """Time the producing side spent (copy into the buffer, or save)."""


class PublishCommand(_Wire):
    version: Version
    save: StrictBool = False
    """Also write a Hugging Face checkpoint (always done with weights = disk)."""


class SaveCommand(_Wire):
    """Write the current policy (HF checkpoint) and the trainer state (weights, Adam, step, buffer)."""

    version: Version


class OpenBatchCommand(_Wire):
    version: Version
    """Policy version the batch starts from (the step produces version + 1)."""
    final: StrictBool
    """Last step of the burst: satellites leave after it (no broadcast)."""


class SwitchResult(_Wire):
    report: SwitchReport
    weights_seconds: float = 0.0
    """Of the switch, the time spent loading weights (to rollout)."""


class LoadResult(_Wire):
    version: str
    seconds: float = Field(ge=0)


class CellEvent(_Wire):
    """Something that happened in the cell, reported in order with the cell's wall clock."""

    seq: int = Field(ge=0)
    at: float
    """Unix time when it happened in the cell."""
    kind: Literal["group_assigned", "microstep_claim", "step_end", "satellite_done", "error"]
    fields: dict[str, Any] = {}


class EventBatch(_Wire):
    events: list[CellEvent]
    next: int
    """Sequence number to ask for next."""


class WorkerStatus(_Wire):
    cell: int
    kind: Literal["elastic", "standalone"]
    ready: bool
    role: str
    weight_version: str
    error: str | None = None
    published: PublishedWeights | None = None
    """The core: the latest published weights (version 0 = the initial model)."""
    engine_url: str | None = None
    """Where this cell's rollout engine serves model calls: the worker's own URL (in-process torch engine) or its
    SGLang server's. None from a worker older than this field: its own URL."""
