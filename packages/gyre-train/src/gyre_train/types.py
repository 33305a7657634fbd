"""Wire types of gyre-train: what the stream packing buffer hands to training cells and what cells send back.

A batch (one optimizer step) is B complete rollout groups of N executions. The packing buffer turns the batch's
selected trajectories into **micro-steps**; a micro-step holds one packed :class:`Shard` per data-parallel rank of a
cell (all cells share one parallel layout) plus the table of executions whose target tokens it contains.

Token alignment inside a shard (T tokens, R rows packed back to back, no padding):

- ``input_ids[p]`` is the model input at packed position p; rows are delimited by ``cu_seqlens`` ([R+1], starts at 0,
  ends at T) and positions restart at 0 in each row (``Shard.position_ids()``), so rows never attend across boundaries.
- ``labels[p]`` is the token predicted at position p (``input_ids[p+1]`` of the same row) or -100 where nothing is
  predicted (last position of a row).
- ``exec_slot[p]`` >= 0 marks a training target: ``labels[p]`` is a policy-sampled token of execution
  ``executions[exec_slot[p]]``; -1 marks context. ``behavior_logprobs[p]`` is the engine's log-prob of that token
  (0.0 at context positions). ``temperatures[p]``, when present, is the temperature that token was sampled at (its
  call's recorded one; the run's at context positions): l_p = log_softmax(logits_p / temperatures[p])[labels[p]]. When
  absent every position uses the micro-step's ``temperature``.

Every execution-level quantity of docs/design/training.md#objective that must be exact across any split is carried in
:class:`ExecutionInfo`: ``num_targets`` = |T_i| over the whole batch and, once the forward-only pre-pass is done,
``log_ratio_sum`` = sum over T_i of (sg(l_t) - b_t), reduced over every row, rank, micro-step and cell.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

IGNORE_LABEL = -100


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = 1


class ExecutionInfo(_Wire):
    """One execution of the batch, as seen by every micro-step that holds some of its target tokens."""

    execution_id: str = Field(min_length=1)
    """Unique id of the execution (from the trajectory records)."""
    group_id: str = Field(min_length=1)
    """Rollout group the execution belongs to."""
    advantage: float
    """Group-relative advantage A_i."""
    num_targets: int = Field(ge=0)
    """|T_i|: target tokens of this execution in the whole batch (union over its admitted trajectories)."""
    staleness: int = Field(ge=0)
    """d = v_t - v_d of the execution's group."""
    log_ratio_sum: float | None = None
    """sum_{t in T_i} (sg(l_t) - b_t) over the whole batch; filled after the pre-pass (None before)."""


class Shard(_Wire):
    """Packed rows for one data-parallel rank: all per-token lists have length T."""

    input_ids: list[int]
    cu_seqlens: list[int]
    labels: list[int]
    exec_slot: list[int]
    behavior_logprobs: list[float]
    temperatures: list[float] | None = None
    """Per position: the sampling temperature of ``labels[p]`` (None: the micro-step's temperature everywhere)."""

    @model_validator(mode="after")
    def _check(self) -> Shard:
        t = len(self.input_ids)
        for name in ("labels", "exec_slot", "behavior_logprobs"):
            if len(getattr(self, name)) != t:
                raise ValueError(f"{name} has length {len(getattr(self, name))}, input_ids has {t}")
        if self.temperatures is not None:
            if len(self.temperatures) != t:
                raise ValueError(f"temperatures has length {len(self.temperatures)}, input_ids has {t}")
            if not all(math.isfinite(x) and x > 0 for x in self.temperatures):
                raise ValueError("temperatures must be finite and > 0")
        cu = self.cu_seqlens
        if not cu or cu[0] != 0 or cu[-1] != t:
            raise ValueError(f"cu_seqlens must start at 0 and end at {t}, got {cu[:3]}...{cu[-3:]}")
        if any(b <= a for a, b in itertools.pairwise(cu)):
            raise ValueError("cu_seqlens must be strictly increasing (no empty rows)")
        for p, (slot, lab) in enumerate(zip(self.exec_slot, self.labels, strict=True)):
            if slot < -1:
                raise ValueError(f"exec_slot[{p}] = {slot} < -1")
            if slot >= 0 and lab < 0:
                raise ValueError(f"position {p} is a target but has no label")
        return self

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def position_ids(self) -> list[int]:
        """Positions restarting at 0 in every row."""
        out: list[int] = []
        for a, b in itertools.pairwise(self.cu_seqlens):
            out.extend(range(b - a))
        return out


class MicroStep(_Wire):
    """Data for one cell's data-parallel ranks (one shard per rank), claimed atomically by one cell."""

    batch: int = Field(ge=0)
    """Index of the batch (optimizer step) this micro-step belongs to."""
    index: int = Field(ge=0)
    """Sequence number of the micro-step inside its batch."""
    norm: int = Field(gt=0)
    """N * B: the fixed number of executions of the batch (the 1/(N*B) of docs/design/training.md#objective)."""
    temperature: float = Field(gt=0)
    """Rollout sampling temperature T (l_t = log_softmax(logits / T)[y_t])."""
    executions: list[ExecutionInfo]
    shards: list[Shard] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> MicroStep:
        n = len(self.executions)
        for r, shard in enumerate(self.shards):
            bad = [s for s in shard.exec_slot if s >= n]
            if bad:
                raise ValueError(
                    f"shard {r} refers to execution slot {bad[0]} but only {n} executions are listed"
                )
        return self

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_targets(self) -> int:
        return sum(1 for s in self.shards for e in s.exec_slot if e >= 0)


class WorkItem(_Wire):
    """One claim from the shared queue: a forward-only pre-pass or a forward-backward of a micro-step."""

    kind: Literal["prepass", "train"]
    microstep: MicroStep


class ExecutionPartial(_Wire):
    """Pre-pass partial sums of one execution over the target tokens of one micro-step."""

    execution_id: str
    log_ratio_sum: float
    """sum (sg(l_t) - b_t) over this micro-step's targets of the execution."""
    count: int = Field(ge=0)


class PrepassResult(_Wire):
    """What a cell returns for a pre-pass item."""

    batch: int
    index: int
    cell: int = Field(ge=0)
    partials: list[ExecutionPartial]


class TokenStats(_Wire):
    """Additive token-level loss statistics (sums, so micro-steps and cells combine by adding)."""

    loss: float = 0.0
    """Sum of this micro-step's loss terms (the batch loss is the sum over micro-steps)."""
    surrogate: float = 0.0
    """sum_t m_i A_i w_t / (N B |T_i|): the logged surrogate (sum w_t A, not sum w_t l_t)."""
    num_targets: int = 0
    num_capped: int = 0
    """Target tokens with rho_t > C (truncated or masked)."""
    weight_sum: float = 0.0
    weight_max: float = 0.0

    def __add__(self, other: TokenStats) -> TokenStats:
        return TokenStats(
            loss=self.loss + other.loss,
            surrogate=self.surrogate + other.surrogate,
            num_targets=self.num_targets + other.num_targets,
            num_capped=self.num_capped + other.num_capped,
            weight_sum=self.weight_sum + other.weight_sum,
            weight_max=max(self.weight_max, other.weight_max),
        )


class TrainResult(_Wire):
    """What a cell returns for a train item (its gradients stay in its backend until the batch ends)."""

    batch: int
    index: int
    cell: int = Field(ge=0)
    stats: TokenStats
    partials: list[ExecutionPartial] = Field(default_factory=list)
    """Single-pass executions (no pre-pass): their sums of (sg(l_t) - b_t), for the batch metrics."""


class StepReport(_Wire):
    """Summary of one optimizer step, written by the core."""

    step: int = Field(ge=0)
    """Index of the step (the policy version before the update)."""
    policy_version: int = Field(ge=0)
    """Policy version after the update."""
    loss: float
    surrogate: float
    grad_norm: float
    """Global gradient norm before clipping."""
    num_groups: int
    num_executions: int
    num_target_tokens: int
    num_microsteps: int
    microsteps_by_cell: dict[int, int]
    """How many train micro-steps each cell processed."""
    group_ids: list[str]
    staleness: list[int]
    """Staleness d of each group, aligned with group_ids."""
    metrics: dict[str, float]
    """Clip fractions, capped-token fraction, weight stats, mean(l-b) by staleness, |s-1| (see loss.batch_metrics)."""
    seconds: float = 0.0
    collective_failed: list[int] = []
    """Satellites whose end-of-batch collective with the core failed (one died or hangs): their items were run
    again by the core, which updated alone; they train again only after the world is re-formed."""


class ReadyExecution(_Wire):
    """One execution of a :class:`ReadyGroupMessage`: reward and advantage as numbers, trajectories as a file."""

    execution_id: str = Field(min_length=1)
    reward: float
    advantage: float
    """A_i, computed once by the controller (gyre-train never recomputes it)."""
    trajectories_path: str | None = None
    """Parquet (``.parquet``) or JSONL (``.jsonl``) file of the execution's selected trajectories written by
    ``gyre_tito.export`` (read with ``gyre_tito.export.read_trajectories``); None: no trajectories (placeholder)."""
    placeholder: bool = False
    """A no_work execution: a valid zero with no targets (its file, if any, holds only the placeholder)."""

    @model_validator(mode="after")
    def _check(self) -> ReadyExecution:
        if not (math.isfinite(self.reward) and math.isfinite(self.advantage)):
            raise ValueError(f"execution {self.execution_id}: reward and advantage must be finite")
        if not self.placeholder and self.trajectories_path is None:
            raise ValueError(
                f"execution {self.execution_id} is not a placeholder but has no trajectories_path"
            )
        return self


class ReadyGroupMessage(_Wire):
    """A complete rollout group crossing a process boundary (controller -> core cell), for
    ``TrajectoryBuffer.add_group_message``: N executions with rewards, advantages and trajectory files."""

    group_id: str = Field(min_length=1)
    policy_version: int = Field(ge=0)
    """v_d: the published version when the group was dispatched."""
    executions: list[ReadyExecution] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> ReadyGroupMessage:
        ids = [e.execution_id for e in self.executions]
        if len(set(ids)) != len(ids):
            raise ValueError(f"group {self.group_id} lists an execution twice")
        return self


class CellRequest(_Wire):
    """A satellite's request to the core's coordinator (control plane of multi-cell training).

    ``leave``: the satellite leaves training now (it holds no claim and is not in a reduce); its reported train
    items of the open batch are requeued (their gradients stay with it) and it does not stay for the next batch.
    """

    op: Literal["join", "claim", "report", "leave"]
    cell: int = Field(ge=1)
    prepass: PrepassResult | None = None
    train: TrainResult | None = None

    @model_validator(mode="after")
    def _check(self) -> CellRequest:
        if self.op == "report" and (self.prepass is None) == (self.train is None):
            raise ValueError("a report carries exactly one of prepass / train")
        if self.op != "report" and (self.prepass is not None or self.train is not None):
            raise ValueError(f"a {self.op} carries no result")
        return self


class CoordinatorReply(_Wire):
    """The coordinator's answer.

    ``joined``: load the weight snapshot at ``snapshot`` and start claiming for ``batch``. ``item``: run ``item``
    (a ``report`` is answered like a ``claim``, so one round trip per item).
    ``wait``: nothing now, ask again. ``batch_done``: accumulation is over; sum gradients into the core over the
    group of the cells ``members`` (the prefix group of ``prefix`` cells when they are a prefix), then receive a
    parameter broadcast if ``broadcast`` (stay for the next batch) or leave training. ``dropped``: this cell was
    removed from the batch (claim lease expired) and its items requeued: discard gradients, join again.
    ``stop``: the run is over; ``members`` are the cells still alive (they leave through one barrier).
    ``ok``: a ``leave`` was accepted (the cell is out of the batch; ``batch_done`` instead if the window had
    already closed with it inside: it must take part in the reduce first).
    """

    status: Literal["ok", "joined", "item", "wait", "batch_done", "dropped", "stop"]
    batch: int | None = None
    item: WorkItem | None = None
    snapshot: str | None = None
    prefix: int | None = Field(default=None, ge=1)
    members: list[int] | None = None
    broadcast: bool = False
    error: str | None = None
