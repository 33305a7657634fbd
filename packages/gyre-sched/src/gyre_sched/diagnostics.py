"""Where a simulated run's time went, per burst and in all: what the training cost hides behind rollout and what it
exposes (issue 43).

A burst starts when the policy dispatches new groups (non-refill dispatches at a new dispatch version) and lasts until
the next one. For each it records when the queue emptied; every cell's entry into training, with the executions
running and the groups ready at that moment; each step's end and the moment the last group it consumed became ready;
the exposed training (the burst's last step's end after its last consumed group's readiness); and its training busy
cell-time, training-role cell-time and idle rollout slot-time.

Run-level figures: ``train_slack = 1 - training busy cell-time / (total cell-time - rollout busy slot-time / C_e)``,
the share of the cell-time rollout left free that training did not use. The standalone pool's slots are counted as
rollout slots like the cells' (its busy time is subtracted in elastic-cell equivalents).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Burst", "BurstLog"]


@dataclass
class Burst:
    start_s: float
    version: int
    """The policy version the burst's groups were dispatched at."""
    groups: int = 0
    queue_empty_s: float | None = None
    joins: list[dict[str, float]] = field(default_factory=list)
    """Each cell's entry into training: ``{"cell", "decided_s", "t", "running", "ready_groups"}``: when the policy
    sent it (its switch began), when it trained, and the executions running and groups ready then."""
    steps: list[dict[str, float | None]] = field(default_factory=list)
    """Each step recorded in the burst: ``{"version", "train_start_s", "end_s", "last_group_ready_s",
    "published_s"}``: its batch's first micro-step, its end, its last consumed group's readiness, and when the
    version it made was published (None if the run ended first)."""
    exposed_training_s: float = 0.0
    train_busy_cell_s: float = 0.0
    training_role_cell_s: float = 0.0
    idle_rollout_slot_s: float = 0.0

    def row(self) -> dict[str, Any]:
        return asdict(self)


class BurstLog:
    """Fed by the simulator as events happen; ``bursts`` and ``totals()`` are its output."""

    def __init__(self, K: int, C_e: int) -> None:
        self.K, self.C_e = K, C_e
        self.bursts: list[Burst] = []
        self._ready_at: dict[str, float] = {}
        self._first_claim: dict[int, float] = {}
        self._sent: dict[int, float] = {}
        self._steps: dict[int, dict[str, float | None]] = {}
        self._t = 0.0
        self._running = 0
        self._capacity = 0
        self._training = 0
        self.rollout_busy_slot_s = 0.0
        self.idle_rollout_slot_s = 0.0
        self.train_busy_cell_s = 0.0
        self.training_role_cell_s = 0.0

    # ---- what happened -------------------------------------------------------------------------------------------
    def dispatched(self, t: float, version: int, refill: bool) -> None:
        if refill:
            return
        if not self.bursts or self.bursts[-1].version != version:
            self._close_burst()
            self.bursts.append(Burst(start_s=t, version=version))
        self.bursts[-1].groups += 1

    def group_ready(self, t: float, group: str) -> None:
        self._ready_at[group] = t

    def sent_to_training(self, t: float, cell: int) -> None:
        self._sent[cell] = t

    def joined_training(self, t: float, cell: int, running: int, ready_groups: int) -> None:
        join = {"cell": cell, "decided_s": self._sent.pop(cell, t), "t": t, "running": running}
        if self.bursts:
            self.bursts[-1].joins.append(join | {"ready_groups": ready_groups})

    def claimed(self, t: float, batch_version: int) -> None:
        """A micro-step of the batch that trains version ``batch_version`` into ``batch_version + 1``."""
        self._first_claim.setdefault(batch_version, t)

    def step(self, t: float, version: int, groups: list[str]) -> None:
        """The step that made ``version`` ended, on ``groups``."""
        ready = max((self._ready_at.pop(g, t) for g in groups), default=t)
        start = self._first_claim.pop(version - 1, t)
        row = {"version": version, "train_start_s": start, "end_s": t, "last_group_ready_s": ready}
        row["published_s"] = None
        self._steps[version] = row
        if self.bursts:
            self.bursts[-1].steps.append(row)

    def published(self, t: float, version: int) -> None:
        if (row := self._steps.pop(version, None)) is not None:
            row["published_s"] = t

    def trained(self, cell_s: float) -> None:
        """Cell-seconds of training compute (micro-steps, start-up, drain, optimizer), charged when begun."""
        self.train_busy_cell_s += cell_s
        if self.bursts:
            self.bursts[-1].train_busy_cell_s += cell_s

    def advance(self, t: float, *, queued: int, running: int, capacity: int, training: int) -> None:
        """Integrate the state held since the last call up to ``t``, then take the state from now on."""
        dt = t - self._t
        if dt > 0:
            idle = max(0, self._capacity - self._running) * dt
            self.rollout_busy_slot_s += min(self._running, self._capacity) * dt
            self.idle_rollout_slot_s += idle
            self.training_role_cell_s += self._training * dt
            if self.bursts:
                self.bursts[-1].idle_rollout_slot_s += idle
                self.bursts[-1].training_role_cell_s += self._training * dt
        self._t, self._running, self._capacity, self._training = t, running, capacity, training
        if self.bursts and self.bursts[-1].queue_empty_s is None and queued == 0:
            self.bursts[-1].queue_empty_s = t

    # ---- what it comes to ----------------------------------------------------------------------------------------
    def _close_burst(self) -> None:
        if self.bursts and self.bursts[-1].steps:
            last = self.bursts[-1].steps[-1]
            self.bursts[-1].exposed_training_s = max(0.0, last["end_s"] - last["last_group_ready_s"])

    def totals(self, end_s: float) -> dict[str, float]:
        self._close_burst()
        total = self.K * end_s
        free = total - self.rollout_busy_slot_s / self.C_e
        exposed = sum(b.exposed_training_s for b in self.bursts)
        return {
            "cell_s": total,
            "train_busy_cell_s": self.train_busy_cell_s,
            "training_role_cell_s": self.training_role_cell_s,
            "rollout_busy_slot_s": self.rollout_busy_slot_s,
            "idle_rollout_slot_s": self.idle_rollout_slot_s,
            "train_slack": 1 - self.train_busy_cell_s / free if free > 0 else 0.0,
            "exposed_training_s": exposed,
            "exposed_training_share": exposed / end_s if end_s else 0.0,
        }
