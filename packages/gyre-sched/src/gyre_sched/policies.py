"""Elastic (the paper), Async (fixed split) and Colocate (whole pool switches): when cells change role."""

from __future__ import annotations

from gyre_sched.config import PolicyParams
from gyre_sched.events import Decision, Join
from gyre_sched.policy import PolicyCore, cell_engine
from gyre_sched.types import CellRole


class ElasticPolicy(PolicyCore):
    """Cells join training one at a time (core first) when eq. 5 and the supply check hold; satellites return at
    burst end; the core stays after publication only if eq. 6 and the supply check hold."""

    kind = "elastic"

    def join_allowed(self) -> bool:
        """Equation 5 for the next cell of the prefix, plus the guards that keep a join safe (no supply timer)."""
        p = self.params
        if self.burst_ending or self.publishing:
            return False
        if any(r in (CellRole.TO_TRAINING, CellRole.TO_ROLLOUT) for r in self.roles):
            return False  # transitions are serial
        if self.k == len(self.trainable()):
            return False
        rest = (self.live_cells - self.k - 1) * p.C_e + p.C_s
        if self.effective_waterlevel() > rest:
            return False
        # Our addition: never leave zero rollout capacity while a group may still drop (its refill could not run).
        return not (rest == 0 and self.ledger.unsettled > 0)

    def _maybe_transition(self, out: list[Decision]) -> None:
        if self.join_allowed() and self._supply_held():
            nxt = next(i for i in self.trainable() if self.roles[i] is CellRole.ROLLOUT)
            self._begin([nxt], out)  # the next cell of the prefix (core first; lost/rollout-only skipped)

    def _core_persists(self, pending: int) -> bool:
        """Equation 6 (+ supply): ready >= rho_min*B and w + pending + refills <= (K-1)*C_e + C_s."""
        p = self.params
        if not self._supply_ok():
            return False
        return self.effective_waterlevel() + pending <= (self.live_cells - 1) * p.C_e + p.C_s


class AsyncPolicy(PolicyCore):
    """A fixed split: cells 0..a-1 train for the whole run, the rest (and the standalone pool) roll out.

    A training satellite that was lost and restarted keeps its place in the split: it takes no rollout work (it is
    out of the destinations and of eq. 3's capacity) while its training side is not back, and once it is
    (`CellRestored(trains=True)`, the next re-form of the training world) it switches to training again. A training
    satellite whose world is gone (`CellUntrained`: a failed re-form) leaves training and waits the same way."""

    kind = "async"

    def _initial_roles(self) -> list[Decision]:
        # Assigned at start-up; only a lost-and-restarted cell ever moves.
        for i in range(self.params.async_train_cells):
            self.roles[i] = CellRole.TRAINING
        out: list[Decision] = []
        self._open_batch(out)
        return out + [Join(i) for i in range(1, self.params.async_train_cells)]

    def _returning(self) -> list[int]:
        """Satellites of the training split back from a loss (or a failed re-form), in rollout: no rollout work."""
        return [
            i
            for i in range(1, self.params.async_train_cells)
            if i not in self.lost and self.roles[i] is CellRole.ROLLOUT
        ]

    def _destinations(self) -> list[str]:
        idle = {cell_engine(i) for i in self._returning()}
        return [e for e in super()._destinations() if e not in idle]

    def capacity(self) -> int:
        return super().capacity() - len(self._returning()) * self.params.C_e

    def _maybe_transition(self, out: list[Decision]) -> None:
        if self.publishing:  # the publication loads rollout engines; the switch waits for it
            return
        for cell in self._returning():  # back to training once its training side is back
            if cell not in self.rollout_only and not self.load[cell_engine(cell)]:
                self._begin([cell], out)

    def _cell_untrained(self, cell: int) -> list[Decision]:
        if cell != 0 and cell not in self.lost and self.roles[cell] is CellRole.TRAINING:
            out: list[Decision] = []
            self._begin([cell], out)  # no world to reduce in: out of training until the next re-form
            self.rollout_only.add(cell)
            self._trainable_pending.discard(cell)
            return out
        return super()._cell_untrained(cell)

    def _stays_in_training(self, cell: int) -> bool:
        return True

    def _core_persists(self, pending: int) -> bool:
        return True


class ColocatePolicy(PolicyCore):
    """The whole pool switches as one unit; after the burst every cell returns to rollout.

    Without streaming it switches once its admitted executions finished (all but what the standalone pool can serve)
    and mu*B groups are ready. With streaming it switches as soon as no execution needs the pool (running <= C_s: the
    stragglers move to the standalone pool, or none is left) and the supply check holds (min(ready, groups the burst
    still needs) >= rho_min*B, no timer): it trains ready groups while evaluations and stragglers finish. It never trains
    while an execution runs on a colocated cell. A batch that can no longer fill while the pool trains (a group dropped
    during training, its refill queued with no rollout capacity left) sends the pool back to rollout with the batch
    kept open; the pool switches again once the refill is done."""

    kind = "colocate"

    def burst_need(self) -> int:
        """Groups the current burst still has to consume (assigned groups of the open batch count as consumed)."""
        p = self.params
        return (self.mu_now - self.step_in_burst) * p.B - (len(self.batch) if self.batch is not None else 0)

    def _maybe_transition(self, out: list[Decision]) -> None:
        p = self.params
        if self.burst_ending or self.publishing:
            return
        # the pool (a restarted rollout-only cell serves on, like a standalone engine)
        live = self.trainable()
        if all(self.roles[i] is CellRole.TRAINING for i in live):
            if self._starved():
                self._begin(live, out)
            return
        if any(self.roles[i] is not CellRole.ROLLOUT for i in live):
            return
        led = self.ledger
        if led.running > p.C_s + len(self.rollout_only) * p.C_e or led.queued:
            return
        if p.streaming:
            if min(len(led.ready), self.burst_need()) < min(p.rho_min * p.B, self.burst_need()) - 1e-9:
                return
            if not led.ready:
                return
        elif len(led.ready) < self.burst_need():
            return
        self._begin(live, out)

    def _starved(self) -> bool:
        """Training waits for a group whose executions cannot launch: the open batch still lacks a group, nothing is
        ready, work is queued, no capacity. A full batch waits for nothing: its step may already be running on the
        core, which must stay in training until it reports it (a drop then waits for the next batch's check)."""
        led = self.ledger
        if self.batch is None or len(self.batch) >= self.params.B:
            return False
        return not led.ready and led.queued > 0 and self.capacity() - led.running <= 0

    def _pool_switching(self) -> bool:
        pool = self.trainable()
        return all(self.roles[i] in (CellRole.TO_TRAINING, CellRole.TRAINING) for i in pool)

    def _on_training(self, cell: int, out: list[Decision]) -> None:
        if self.batch is None and all(self.roles[i] is CellRole.TRAINING for i in self.trainable()):
            self._open_batch(out)


POLICIES: dict[str, type[PolicyCore]] = {
    "elastic": ElasticPolicy,
    "async": AsyncPolicy,
    "colocate": ColocatePolicy,
}


def make_policy(params: PolicyParams, *, deep_checks: bool = False) -> PolicyCore:
    return POLICIES[params.kind](params, deep_checks=deep_checks)
