"""Trajectory buffer: execution records and rewards by rollout group; hands out complete groups, oldest first.

A group becomes ready when all N of its executions have a valid reward (a placeholder execution with reward 0 and
no targets counts as valid). Ready groups are handed out oldest policy version (v_d) first, ties in the order they
became ready. Incomplete groups are never handed out; a group that can no longer complete is removed with
:meth:`TrajectoryBuffer.drop_group`. ``state_dict`` / ``load_state_dict`` preserve the exact hand-out order for
checkpoints. All methods are thread-safe: assessed executions usually arrive on another thread than the trainer's.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass, field
from typing import Any

from gyre_tito.types import Trajectory


@dataclass(frozen=True, slots=True)
class ExecutionEntry:
    """One execution of a group: its reward and admitted trajectories (empty for a placeholder)."""

    execution_id: str
    reward: float
    trajectories: tuple[Trajectory, ...]

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
    executions: dict[str, ExecutionEntry] = field(default_factory=dict)


class TrajectoryBuffer:
    """Holds executions by group until each group is complete; pops ready groups oldest policy version first."""

    def __init__(self, group_size: int) -> None:
        if group_size <= 0:
            raise ValueError("group_size must be > 0")
        self.group_size = group_size
        self._pending: dict[str, _Pending] = {}
        self._ready: list[tuple[int, int, ReadyGroup]] = []  # heap of (policy_version, seq, group)
        self._seq = 0
        self._consumed: set[str] = set()
        self._lock = threading.RLock()

    def add_execution(
        self,
        group_id: str,
        policy_version: int,
        execution_id: str,
        reward: float,
        trajectories: list[Trajectory] | tuple[Trajectory, ...] = (),
    ) -> ReadyGroup | None:
        """Record one assessed execution; returns the group if this execution completed it."""
        with self._lock:
            if group_id in self._consumed or any(g.group_id == group_id for _, _, g in self._ready):
                raise ValueError(f"group {group_id} is already complete")
            for t in trajectories:
                if t.execution_id != execution_id or t.group_id != group_id:
                    raise ValueError(
                        f"trajectory of {t.execution_id}/{t.group_id} added under {execution_id}/{group_id}"
                    )
            pending = self._pending.setdefault(group_id, _Pending(policy_version))
            if pending.policy_version != policy_version:
                raise ValueError(
                    f"group {group_id} was dispatched at version {pending.policy_version}, not {policy_version}"
                )
            if execution_id in pending.executions:
                raise ValueError(f"execution {execution_id} was already added to group {group_id}")
            pending.executions[execution_id] = ExecutionEntry(
                execution_id, float(reward), tuple(trajectories)
            )
            if len(pending.executions) < self.group_size:
                return None
            del self._pending[group_id]
            group = ReadyGroup(group_id, policy_version, tuple(pending.executions.values()), self._seq)
            self._seq += 1
            heapq.heappush(self._ready, (group.policy_version, group.seq, group))
            return group

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
                    "trajectories": [t.model_dump(mode="json") for t in e.trajectories],
                }

            return {
                "group_size": self.group_size,
                "seq": self._seq,
                "consumed": sorted(self._consumed),
                "ready": [
                    {"group_id": g.group_id, "policy_version": g.policy_version, "seq": g.seq,
                     "executions": [entry(e) for e in g.executions]}
                    for _, _, g in sorted(self._ready)
                ],
                "pending": [
                    {"group_id": gid, "policy_version": p.policy_version,
                     "executions": [entry(e) for e in p.executions.values()]}
                    for gid, p in self._pending.items()
                ],
            }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:

            def entry(d: dict[str, Any]) -> ExecutionEntry:
                trajs = tuple(Trajectory.model_validate(t) for t in d["trajectories"])
                return ExecutionEntry(d["execution_id"], float(d["reward"]), trajs)

            if state["group_size"] != self.group_size:
                raise ValueError(f"checkpoint group_size {state['group_size']} != {self.group_size}")
            self._seq = int(state["seq"])
            self._consumed = set(state["consumed"])
            self._ready = []
            for g in state["ready"]:
                group = ReadyGroup(
                    g["group_id"], g["policy_version"], tuple(entry(e) for e in g["executions"]), g["seq"]
                )
                heapq.heappush(self._ready, (group.policy_version, group.seq, group))
            self._pending = {}
            for g in state["pending"]:
                pending = _Pending(g["policy_version"])
                for e in g["executions"]:
                    pending.executions[e["execution_id"]] = entry(e)
                self._pending[g["group_id"]] = pending
