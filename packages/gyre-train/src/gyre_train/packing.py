"""Stream packing buffer: ready groups -> token rows -> packed micro-steps, selecting a batch's B groups incrementally.

Materialization: a trajectory of n tokens becomes one row predicting its own targets: inputs ``token_ids[:k]``,
labels ``token_ids[1:k+1]`` where k+1 is one past its last target (trailing context predicts nothing and is cut); the
target at trajectory position p (``target_mask[p] == 1``) is the label at row position p-1. A trajectory without
targets (a placeholder) makes no row, but its execution still counts in the batch's N*B.

Packing: rows wait in a window; when the window holds enough tokens (or the batch's last group has been pulled),
rows are sorted longest first and placed first-fit into shards of ``tokens_per_shard`` tokens (a row longer than
that gets a shard of its own: causal rows cannot be split). Shards are grouped ``dp_size`` at a time into micro-steps,
balancing ranks. Before the last group only shards that are nearly full are emitted; the remainder waits for more rows,
which keeps the non-pad fraction high on long-tailed lengths.

Every micro-step carries the ExecutionInfo (A_i, |T_i|, d) of the executions it touches, so the loss of any split
equals the batch loss (``gyre_train.loss``). A_i is the group entry's given advantage
(``gyre_train.buffer.ExecutionEntry.advantage``): packing never computes one.

Groups are pulled lazily, oldest v_d first, only when the row window runs low; ``on_group(group, batch)`` is called
at the moment a group joins the open batch, before any micro-step holding its rows exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gyre_train.buffer import ReadyGroup, TrajectoryBuffer
from gyre_train.types import ExecutionInfo, MicroStep, Shard


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingConfig:
    """Settings of the stream packing buffer."""

    group_size: int
    """N: executions per group."""
    batch_groups: int
    """B: groups per batch (one optimizer step)."""
    tokens_per_shard: int = 4096
    """Token capacity of one data-parallel rank's shard in a micro-step."""
    dp_size: int = 1
    """Data-parallel ranks per cell: shards per micro-step."""
    window_shards: int = 8
    """Pull groups until the row window holds this many shards' worth of tokens before packing."""
    min_fill: float = 0.98
    """Before the batch's last group, only emit shards at least this full."""
    temperature: float = 1.0
    """Rollout temperature of the batch's samples (a trajectory's recorded per-call temperatures take precedence)."""
    # advantage_mode was removed: advantages come with the groups (TrajectoryBuffer.add_group, or the buffer's
    # advantage_mode for add_execution).

    def __post_init__(self) -> None:
        if (
            min(self.group_size, self.batch_groups, self.tokens_per_shard, self.dp_size, self.window_shards)
            <= 0
        ):
            raise ValueError(
                "group_size, batch_groups, tokens_per_shard, dp_size and window_shards must be > 0"
            )
        if not 0.0 < self.min_fill <= 1.0:
            raise ValueError("min_fill must be in (0, 1]")


@dataclass(slots=True, eq=False)
class Row:
    """One materialized trajectory row."""

    execution_id: str
    input_ids: list[int]
    labels: list[int]
    target: list[bool]
    behavior_logprobs: list[float]
    temperatures: list[float] | None = None
    """Per position: the sampling temperature of the label there (0.0 off target); None: not recorded."""

    def __len__(self) -> int:
        return len(self.input_ids)


def materialize(trajectory) -> Row | None:
    """Row of one gyre_tito Trajectory (None if it has no targets)."""
    mask = trajectory.target_mask
    last = max((p for p, m in enumerate(mask) if m), default=-1)
    if last < 0:
        return None
    if mask[0]:
        raise ValueError(
            f"trajectory {trajectory.execution_id}/{trajectory.index}: position 0 cannot be a target"
        )
    ids = trajectory.token_ids
    temps = getattr(trajectory, "temperatures", None)  # recorded per call (gyre_tito >= this field)
    return Row(
        execution_id=trajectory.execution_id,
        input_ids=list(ids[:last]),
        labels=list(ids[1 : last + 1]),
        target=[bool(m) for m in mask[1 : last + 1]],
        behavior_logprobs=list(trajectory.behavior_logprobs[1 : last + 1]),
        temperatures=list(temps[1 : last + 1]) if temps else None,
    )


def pack_rows(rows: list[Row], capacity: int) -> list[list[Row]]:
    """First-fit decreasing into bins of ``capacity`` tokens (oversized rows alone). Deterministic."""
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]), i))
    bins: list[list[Row]] = []
    free: list[int] = []
    for i in order:
        row = rows[i]
        for b, room in enumerate(free):
            if len(row) <= room:
                bins[b].append(row)
                free[b] -= len(row)
                break
        else:
            bins.append([row])
            free.append(capacity - len(row))
    return bins


def _fill(pool: list[Row], capacity: int) -> list[Row]:
    """Greedily take rows (pool sorted longest first) into one shard of ``capacity`` tokens; removes them."""
    taken, rest, room = [], [], capacity
    for row in pool:
        if len(row) <= room:
            taken.append(row)
            room -= len(row)
        else:
            rest.append(row)
    pool[:] = rest
    return taken


def plan_microsteps(
    rows: list[Row], capacity: int, dp: int, min_fill: float, final: bool
) -> tuple[list[list[list[Row]]], list[Row]]:
    """Group rows into micro-steps of ``dp`` shards: (micro-steps as lists of shards of rows, rows kept for later).

    A row longer than ``capacity`` anchors a micro-step whose other ranks are filled up to that row's length (the
    ranks wait for the longest shard anyway). Other rows go first-fit decreasing into shards of ``capacity``; shards
    of similar size share a micro-step. Unless ``final``, only micro-steps whose every shard is at least
    ``min_fill`` full are planned; the rest stays in the window.
    """
    big = sorted((r for r in rows if len(r) > capacity), key=len, reverse=True)
    small = sorted((r for r in rows if len(r) <= capacity), key=len, reverse=True)
    plans: list[list[list[Row]]] = []
    kept: list[Row] = []
    for row in big:
        length = len(row)
        partners = [_fill(small, length) for _ in range(dp - 1)]
        if final or all(sum(map(len, p)) >= min_fill * length for p in partners):
            plans.append([[row], *[p for p in partners if p]])
        else:
            kept.append(row)
            small = sorted(small + [r for p in partners for r in p], key=len, reverse=True)
    bins = sorted(pack_rows(small, capacity), key=lambda b: -sum(map(len, b)))
    if not final:
        full = [b for b in bins if sum(map(len, b)) >= min_fill * capacity]
        n = len(full) - len(full) % dp
        kept += [r for b in bins[n:] for r in b]  # bins are sorted: the full ones come first
        bins = bins[:n]
    plans += [bins[k : k + dp] for k in range(0, len(bins), dp)]
    return plans, kept


def build_shard(rows: list[Row], slots: dict[str, int], temperature: float = 1.0) -> Shard:
    """Rows packed back to back. When any row carries its calls' recorded temperatures, the shard holds one per
    position: the recorded one on targets, ``temperature`` (the run's) everywhere else and for rows without."""
    ids, labels, exec_slot, blp, temps, cu = [], [], [], [], [], [0]
    for row in rows:
        ids.extend(row.input_ids)
        labels.extend(row.labels)
        slot = slots[row.execution_id]
        exec_slot.extend(slot if t else -1 for t in row.target)
        blp.extend(b if t else 0.0 for b, t in zip(row.behavior_logprobs, row.target, strict=True))
        recorded = row.temperatures or [0.0] * len(row)
        temps.extend(r if (t and r > 0) else temperature for r, t in zip(recorded, row.target, strict=True))
        cu.append(len(ids))
    per_token = temps if any(r.temperatures for r in rows) else None
    return Shard(
        input_ids=ids,
        cu_seqlens=cu,
        labels=labels,
        exec_slot=exec_slot,
        behavior_logprobs=blp,
        temperatures=per_token,
    )


@dataclass(slots=True)
class _Batch:
    index: int
    policy_version: int
    groups: list[ReadyGroup] = field(default_factory=list)
    infos: dict[str, ExecutionInfo] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    emitted: int = 0
    closed: bool = False


class StreamPackingBuffer:
    """Turns ready groups into micro-steps for one batch at a time (see the module docstring)."""

    def __init__(self, cfg: PackingConfig, source: TrajectoryBuffer) -> None:
        if source.group_size != cfg.group_size:
            raise ValueError(f"buffer group_size {source.group_size} != packing group_size {cfg.group_size}")
        self.cfg = cfg
        self.source = source
        self._batch: _Batch | None = None
        self.on_group: Callable[[ReadyGroup, int], None] | None = None
        """Called with (group, batch index) when a group is pulled into the open batch."""

    def open_batch(self, index: int, policy_version: int) -> None:
        """Start batch ``index``, trained at policy version ``policy_version`` (v_t)."""
        if self._batch is not None and not self._batch.closed:
            raise RuntimeError(f"batch {self._batch.index} is still open")
        self._batch = _Batch(index, policy_version)

    @property
    def closed(self) -> bool:
        """True once all B groups are selected and all their micro-steps emitted."""
        return self._batch is not None and self._batch.closed

    @property
    def groups(self) -> list[ReadyGroup]:
        return list(self._batch.groups) if self._batch else []

    @property
    def executions(self) -> list[ExecutionInfo]:
        """ExecutionInfo of every execution selected so far (placeholders included)."""
        return list(self._batch.infos.values()) if self._batch else []

    def _pull(self, batch: _Batch) -> bool:
        group = self.source.pop_ready()
        if group is None:
            return False
        d = batch.policy_version - group.policy_version
        if d < 0:
            raise ValueError(
                f"group {group.group_id} is from version {group.policy_version} > {batch.policy_version}"
            )
        for e in group.executions:
            if e.execution_id in batch.infos:
                raise ValueError(f"execution {e.execution_id} appears twice in batch {batch.index}")
            batch.infos[e.execution_id] = ExecutionInfo(
                execution_id=e.execution_id,
                group_id=group.group_id,
                advantage=e.advantage,
                num_targets=e.num_targets,
                staleness=d,
            )
            for t in e.trajectories:
                row = materialize(t)
                if row is not None:
                    batch.rows.append(row)
        batch.groups.append(group)
        if self.on_group is not None:  # before any micro-step holding its rows is planned
            self.on_group(group, batch.index)
        return True

    def next_microsteps(self, max_microsteps: int | None = None) -> list[MicroStep]:
        """Pull groups as needed and return the micro-steps that are ready now ([] = waiting for ready groups)."""
        batch = self._batch
        if batch is None or batch.closed:
            return []
        cfg = self.cfg
        window = cfg.window_shards * cfg.tokens_per_shard
        while len(batch.groups) < cfg.batch_groups and sum(map(len, batch.rows)) < window:
            if not self._pull(batch):
                break
        while True:
            last = len(batch.groups) == cfg.batch_groups
            ready, keep = plan_microsteps(batch.rows, cfg.tokens_per_shard, cfg.dp_size, cfg.min_fill, last)
            # no full micro-step yet: widen the window by one more group, if one is ready
            if ready or last or not self._pull(batch):
                break
        if max_microsteps is not None and not last:
            keep = [r for m in ready[max_microsteps:] for b in m for r in b] + keep
            ready = ready[:max_microsteps]
        batch.rows = keep
        out = self._to_microsteps(batch, ready)
        if last and not batch.rows:
            batch.closed = True
        return out

    def _to_microsteps(self, batch: _Batch, plans: list[list[list[Row]]]) -> list[MicroStep]:
        cfg = self.cfg
        out = []
        for group in plans:
            exec_ids = sorted({r.execution_id for b in group for r in b})
            slots = {e: i for i, e in enumerate(exec_ids)}
            shards = [build_shard(b, slots, cfg.temperature) for b in group]
            while len(shards) < cfg.dp_size:  # the batch's last micro-step may leave ranks idle
                shards.append(
                    Shard(
                        input_ids=[0],
                        cu_seqlens=[0, 1],
                        labels=[-100],
                        exec_slot=[-1],
                        behavior_logprobs=[0.0],
                    )
                )
            microstep = MicroStep(
                batch=batch.index,
                index=batch.emitted,
                norm=cfg.group_size * cfg.batch_groups,
                temperature=cfg.temperature,
                executions=[batch.infos[e] for e in exec_ids],
                shards=shards,
            )
            out.append(microstep)
            batch.emitted += 1
        return out


def padding_efficiency(microsteps: list[MicroStep], capacity: int) -> float:
    """Non-pad token fraction when every rank's shard is padded to max(capacity, longest shard of its micro-step)."""
    real = sum(
        s.num_tokens for m in microsteps for s in m.shards if s.exec_slot != [-1] or s.labels != [-100]
    )
    slots = sum(len(m.shards) * max(capacity, *(s.num_tokens for s in m.shards)) for m in microsteps)
    return real / slots if slots else 0.0
