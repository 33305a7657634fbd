"""Trajectory buffer: complete rollout groups with their rewards and advantages; hands out oldest first.

A group is ready when all N of its executions have a valid reward (a placeholder execution with reward 0 and no
targets counts as valid). Ready groups are handed out oldest policy version (v_d) first, ties in the order they
became ready. ``state_dict`` / ``load_state_dict`` preserve the exact hand-out order for checkpoints. All methods are
thread-safe: groups usually arrive on another thread than the trainer's.

Two ways in:

- :meth:`TrajectoryBuffer.add_group` (the real run): the controller hands a complete group at once, with each
  execution's reward **and advantage as numbers** (computed once, from gyre-eval's rewards and gyre-sched's group
  membership). :meth:`TrajectoryBuffer.add_group_message` does the same from a
  :class:`~gyre_train.types.ReadyGroupMessage` whose trajectories are files written by ``gyre_tito.export``.
- :meth:`TrajectoryBuffer.add_execution` (tests, ``gyre_train.testing.synthetic``, benchmarks): one execution at a time; the
  execution that completes the group fills every advantage with :func:`gyre_eval.groups.group_advantages` (the one formula)
  (``advantage_mode`` of the buffer). An incomplete group is never handed out; one that can no longer complete is
  removed with :meth:`TrajectoryBuffer.drop_group`.

Nothing downstream computes an advantage: packing copies :attr:`ExecutionEntry.advantage` into the micro-steps.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_eval.groups import group_advantages
from gyre_eval.types import AdvantageMode
from gyre_tito.types import Trajectory
from gyre_train.types import ReadyGroupMessage


@dataclass(frozen=True, slots=True)
class ExecutionEntry:
    """One execution of a group: its reward, its advantage A_i and its admitted trajectories (empty: no work)."""

    execution_id: str
    reward: float
    advantage: float
    """A_i, given (add_group) or filled from the group's rewards (add_execution); never recomputed downstream."""
    trajectories: tuple[Trajectory, ...] = ()

    @property
    def num_targets(self) -> int:
        return sum(t.num_targets for t in self.trajectories)


@dataclass(frozen=True, slots=True)
class ReadyGroup:
    """A complete rollout group: exactly N executions with valid rewards."""

    group_id: str
    policy_version: int
    """v_d: the published version when the group was dispatched."""
    executions: tuple[ExecutionEntry, ...]
    seq: int
    """Order in which the group became ready (ties of policy_version break on it)."""


@dataclass(slots=True)
class _Pending:
    policy_version: int
    executions: dict[str, tuple[float, tuple[Trajectory, ...]]] = field(default_factory=dict)
    """execution_id -> (reward, trajectories), in arrival order (advantages come when the group completes)."""


def _check_trajectories(group_id: str, execution_id: str, trajectories: Sequence[Trajectory]) -> None:
    for t in trajectories:
        if t.execution_id != execution_id or t.group_id != group_id:
            raise ValueError(
                f"trajectory of {t.execution_id}/{t.group_id} added under {execution_id}/{group_id}"
            )


class TrajectoryBuffer:
    """Holds complete groups (and, for ``add_execution``, incomplete ones); pops ready groups oldest v_d first."""

    def __init__(self, group_size: int, advantage_mode: AdvantageMode = "grpo") -> None:
        if group_size <= 0:
            raise ValueError("group_size must be > 0")
        self.group_size = group_size
        self.advantage_mode: AdvantageMode = advantage_mode
        """Only for ``add_execution``: how the completing execution fills its group's advantages."""
        self._pending: dict[str, _Pending] = {}
        self._ready: list[tuple[int, int, ReadyGroup]] = []  # heap of (policy_version, seq, group)
        self._seq = 0
        self._consumed: set[str] = set()
        self._lock = threading.RLock()
        self._arrived = threading.Condition(self._lock)

    def _check_new(self, group_id: str) -> None:
        if group_id in self._consumed or any(g.group_id == group_id for _, _, g in self._ready):
            raise ValueError(f"group {group_id} is already complete")

    def _push(self, group_id: str, policy_version: int, executions: tuple[ExecutionEntry, ...]) -> ReadyGroup:
        group = ReadyGroup(group_id, policy_version, executions, self._seq)
        self._seq += 1
        heapq.heappush(self._ready, (group.policy_version, group.seq, group))
        self._arrived.notify_all()
        return group

    def add_group(
        self, group_id: str, policy_version: int, executions: Sequence[ExecutionEntry]
    ) -> ReadyGroup:
        """Add a complete group at once: exactly N executions, each with its reward and its given advantage.

        This is the real run's way in: the controller computes advantages once and hands them as numbers. An
        execution without work (a no_work placeholder) has no trajectories or only a placeholder trajectory; it
        counts in N*B with no targets. Returns the ready group. Raises ValueError (and adds nothing) when the
        group is already known, has the wrong size, repeats an execution, holds a non-finite reward or advantage,
        or a trajectory of another execution or group.
        """
        if len(executions) != self.group_size:
            raise ValueError(
                f"group {group_id} has {len(executions)} executions, the buffer's groups have {self.group_size}"
            )
        entries = []
        for e in executions:
            if not (math.isfinite(e.reward) and math.isfinite(e.advantage)):
                raise ValueError(
                    f"execution {e.execution_id} of group {group_id}: reward {e.reward} and advantage "
                    f"{e.advantage} must be finite"
                )
            _check_trajectories(group_id, e.execution_id, e.trajectories)
            entries.append(
                ExecutionEntry(e.execution_id, float(e.reward), float(e.advantage), tuple(e.trajectories))
            )
        ids = [e.execution_id for e in entries]
        if len(set(ids)) != len(ids):
            raise ValueError(f"group {group_id} lists an execution twice: {sorted(ids)}")
        with self._lock:
            self._check_new(group_id)
            if group_id in self._pending:
                raise ValueError(f"group {group_id} already has executions added one by one (add_execution)")
            return self._push(group_id, policy_version, tuple(entries))

    def add_group_message(self, message: ReadyGroupMessage, root: str | Path | None = None) -> ReadyGroup:
        """Add the group a :class:`~gyre_train.types.ReadyGroupMessage` describes (it crossed a process boundary).

        Each execution's trajectories are read from its ``trajectories_path`` (Parquet or JSONL written by
        ``gyre_tito.export``; relative paths are taken from ``root``, else the working directory) with
        ``gyre_tito.export.read_trajectories``. Raises ValueError naming the file when a trajectory belongs to
        another execution or group, when a placeholder execution's file holds targets, or when a scored
        execution's file holds the placeholder trajectory; nothing is added then (and as ``add_group``).
        """
        from gyre_tito.export import read_trajectories

        entries = []
        for e in message.executions:
            trajectories: list[Trajectory] = []
            if e.trajectories_path is not None:
                path = Path(e.trajectories_path)
                if root is not None and not path.is_absolute():
                    path = Path(root) / path
                trajectories = read_trajectories(path)
                where = f"{path} (execution {e.execution_id} of group {message.group_id})"
                for t in trajectories:
                    if t.execution_id != e.execution_id or t.group_id != message.group_id:
                        raise ValueError(f"{where} holds a trajectory of {t.execution_id}/{t.group_id}")
                    if e.placeholder and t.num_targets:
                        raise ValueError(f"{where}: a placeholder execution has a trajectory with targets")
                    if not e.placeholder and t.placeholder:
                        raise ValueError(f"{where}: a scored execution holds the placeholder trajectory")
            entries.append(ExecutionEntry(e.execution_id, e.reward, e.advantage, tuple(trajectories)))
        return self.add_group(message.group_id, message.policy_version, entries)

    def add_execution(
        self,
        group_id: str,
        policy_version: int,
        execution_id: str,
        reward: float,
        trajectories: list[Trajectory] | tuple[Trajectory, ...] = (),
    ) -> ReadyGroup | None:
        """Record one assessed execution; returns the group if this execution completed it.

        A convenience for tests, ``gyre_train.testing.synthetic`` and benchmarks: the completing execution fills the
        group's advantages with :func:`gyre_eval.groups.group_advantages` (the one formula) (``self.advantage_mode``). The real
        run hands complete groups with their advantages to :meth:`add_group`.
        """
        with self._lock:
            self._check_new(group_id)
            _check_trajectories(group_id, execution_id, trajectories)
            pending = self._pending.setdefault(group_id, _Pending(policy_version))
            if pending.policy_version != policy_version:
                raise ValueError(
                    f"group {group_id} was dispatched at version {pending.policy_version}, not {policy_version}"
                )
            if execution_id in pending.executions:
                raise ValueError(f"execution {execution_id} was already added to group {group_id}")
            pending.executions[execution_id] = (float(reward), tuple(trajectories))
            if len(pending.executions) < self.group_size:
                return None
            advantages = group_advantages([r for r, _ in pending.executions.values()], self.advantage_mode)
            del self._pending[group_id]
            entries = tuple(
                ExecutionEntry(eid, r, a, trajs)
                for (eid, (r, trajs)), a in zip(pending.executions.items(), advantages, strict=True)
            )
            return self._push(group_id, policy_version, entries)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until a ready group is held (True) or ``timeout`` seconds pass (False)."""
        with self._arrived:
            return self._arrived.wait_for(lambda: bool(self._ready), timeout)

    def drop_group(self, group_id: str) -> None:
        """Forget an incomplete group (it can no longer reach N valid rewards)."""
        with self._lock:
            if self._pending.pop(group_id, None) is None:
                raise KeyError(f"no incomplete group {group_id}")

    def pop_ready(self) -> ReadyGroup | None:
        """The ready group with the oldest policy version (None if none is ready)."""
        with self._lock:
            if not self._ready:
                return None
            group = heapq.heappop(self._ready)[2]
            self._consumed.add(group.group_id)
            return group

    @property
    def num_ready(self) -> int:
        with self._lock:
            return len(self._ready)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able content: ready and pending groups, the ready counter and the consumed group ids."""
        with self._lock:

            def entry(e: ExecutionEntry) -> dict[str, Any]:
                return {
                    "execution_id": e.execution_id,
                    "reward": e.reward,
                    "advantage": e.advantage,
                    "trajectories": [t.model_dump(mode="json") for t in e.trajectories],
                }

            def pending_entry(eid: str, reward: float, trajs: tuple[Trajectory, ...]) -> dict[str, Any]:
                return {
                    "execution_id": eid,
                    "reward": reward,
                    "trajectories": [t.model_dump(mode="json") for t in trajs],
                }

            return {
                "group_size": self.group_size,
                "seq": self._seq,
                "consumed": sorted(self._consumed),
                "ready": [
                    {
                        "group_id": g.group_id,
                        "policy_version": g.policy_version,
                        "seq": g.seq,
                        "executions": [entry(e) for e in g.executions],
                    }
                    for _, _, g in sorted(self._ready)
                ],
                "pending": [
                    {
                        "group_id": gid,
                        "policy_version": p.policy_version,
                        "executions": [pending_entry(eid, r, ts) for eid, (r, ts) in p.executions.items()],
                    }
                    for gid, p in self._pending.items()
                ],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:

            def trajs(d: dict[str, Any]) -> tuple[Trajectory, ...]:
                return tuple(Trajectory.model_validate(t) for t in d["trajectories"])

            def entries(execs: list[dict[str, Any]]) -> tuple[ExecutionEntry, ...]:
                if all("advantage" in d for d in execs):
                    advantages = [float(d["advantage"]) for d in execs]
                else:  # a checkpoint from before advantages were stored: they were GRPO of the rewards
                    advantages = group_advantages([float(d["reward"]) for d in execs], self.advantage_mode)
                return tuple(
                    ExecutionEntry(d["execution_id"], float(d["reward"]), a, trajs(d))
                    for d, a in zip(execs, advantages, strict=True)
                )

            if state["group_size"] != self.group_size:
                raise ValueError(f"checkpoint group_size {state['group_size']} != {self.group_size}")
            self._seq = int(state["seq"])
            self._consumed = set(state["consumed"])
            self._ready = []
            for g in state["ready"]:
                group = ReadyGroup(g["group_id"], g["policy_version"], entries(g["executions"]), g["seq"])
                heapq.heappush(self._ready, (group.policy_version, group.seq, group))
            self._pending = {}
            for g in state["pending"]:
                pending = _Pending(g["policy_version"])
                for e in g["executions"]:
                    pending.executions[e["execution_id"]] = (float(e["reward"]), trajs(e))
                self._pending[g["group_id"]] = pending
