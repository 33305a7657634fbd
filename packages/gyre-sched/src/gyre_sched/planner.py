"""Burst planners: what each burst of boundary dispatch uses (mu, the groups dispatched at its publication, spares).

``FixedPlanner`` is the paper: every burst dispatches mu*B groups (phi*B more at start) with k_spare spares each.

``AdaptivePlanner`` (``PolicyParams(planner="adaptive", target_staleness=...)``) holds a target *realized* mean
staleness and otherwise dispatches as little as it can. It rests on a counting identity: over S steps, the groups'
staleness sums to sum_s (O_s - B), where O_s is the number of dispatched, not yet consumed (and never dropped) groups at
the start of step s. So the mean staleness is mean_s(O_s)/B - 1, whatever the durations, and a burst of mu steps
starting with O groups outstanding adds mu*(O - B) - B*mu*(mu-1)/2. At each publication it

1. measures the staleness accrued so far, A = sum of consumed groups' d + outstanding groups' age in steps (what they
   have already waited), against the target's share, target * B * steps;
2. picks the burst's mu (``mu_rule``): ``fixed`` (default) keeps params.mu (``gyre-sched plan`` recommends one);
   ``capacity`` takes the largest mu <= mu_max whose dispatch fits ``overflow`` times the rollout capacity not held by
   running executions (a dispatch beyond it runs as a second wave whose groups end the burst late); ``learn`` takes the
   mu whose recent bursts took least time per step, trying each untried neighbour once. On the nl2repo preset both
   state-driven rules were slower than keeping mu = 3 (capacity: 69.6-72.0 h, learn: 69.4-73.3 h, fixed: 69.0 h at
   E[d] = 1.5): bursts are too few and too noisy to learn from, and the second wave is cheaper than more publications;
3. dispatches D = O - outstanding groups with O = B * (r + 1 + (mu - 1)/2), where r = target + (target*B*steps - A) /
   (B * horizon) makes up any difference over the next ``horizon`` steps; never fewer than the burst consumes;
4. picks spares: k_spare (the configured maximum) while the groups seen so far show that spares rescue groups (a share
   of settled groups with 1..k exclusions above 1/N: a spare costs 1/N of a group, a rescue saves one), else 0; idle
   spares cost nothing unless they run, so they are always kept.

The staleness it reports is the realized one (``PolicyCore.staleness``, per consumed group), never eq. 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gyre_sched.ledger import GroupState

if TYPE_CHECKING:
    from gyre_sched.config import PolicyParams
    from gyre_sched.policy import PolicyCore


@dataclass(frozen=True, slots=True)
class BurstPlan:
    mu: int
    """Steps before the next publication."""
    dispatch: int
    """Groups dispatched now."""
    k_spare: int
    """Spares per dispatched group."""


class FixedPlanner:
    """(phi, mu, k_spare) every burst: d(0) = (phi + mu) * B groups, then mu * B after each publication."""

    def __init__(self, params: PolicyParams) -> None:
        self.params = params

    def first(self, core: PolicyCore) -> BurstPlan:
        p = self.params
        return BurstPlan(p.mu, p.phi_B + p.mu * p.B, p.k_spare)

    def next(self, core: PolicyCore) -> BurstPlan:
        p = self.params
        return BurstPlan(p.mu, p.mu * p.B, p.k_spare)


def outstanding_groups(core: PolicyCore) -> list:
    """Dispatched groups neither consumed nor dropped."""
    return [
        g for g in core.ledger.groups.values() if g.state not in (GroupState.CONSUMED, GroupState.DROPPED)
    ]


def accrued_staleness(core: PolicyCore) -> int:
    """Staleness accrued by the current version: consumed groups' d plus outstanding groups' age in steps."""
    return sum(core.staleness) + sum(core.version - g.v_d for g in outstanding_groups(core))


class AdaptivePlanner:
    """See the module docstring."""

    def __init__(
        self,
        params: PolicyParams,
        *,
        horizon_steps: int | None = None,
        mu_rule: Literal["fixed", "learn", "capacity"] = "fixed",
    ) -> None:
        self.params = params
        self.target = params.staleness_target
        self.mu_max = params.mu_max or max(1, math.floor(2 * self.target + 1 + 1e-9))
        self.horizon = horizon_steps or 3 * self.mu_max
        self.mu_rule = mu_rule
        self.overflow = 1.5
        self.seconds_per_step: dict[int, list[float]] = {}  # per mu tried: its bursts' seconds per step
        self._burst: tuple[int, float, int] | None = None  # (mu, start time, version at start)

    def first(self, core: PolicyCore) -> BurstPlan:
        return self._plan(core)

    def next(self, core: PolicyCore) -> BurstPlan:
        return self._plan(core)

    def _plan(self, core: PolicyCore) -> BurstPlan:
        B = self.params.B
        outstanding = len(outstanding_groups(core))
        r = self.target + (self.target * B * core.version - accrued_staleness(core)) / (B * self.horizon)
        k = self._spares(core)
        if self._burst is not None:  # what the burst that just ended took per step
            mu0, t0, v0 = self._burst
            if core.version > v0:
                self.seconds_per_step.setdefault(mu0, []).append((core.now - t0) / (core.version - v0))
        mu = self._choose_mu(core, r, outstanding, k)
        self._burst = (mu, core.now, core.version)
        return BurstPlan(mu, self._dispatch(r, mu, outstanding), k)

    def _dispatch(self, r: float, mu: int, outstanding: int) -> int:
        """Groups to dispatch for a burst of mu steps to start with B * (r + 1 + (mu - 1)/2) outstanding."""
        B = self.params.B
        return max(round(B * (r + 1 + (mu - 1) / 2)) - outstanding, mu * B - outstanding, 0)

    def _choose_mu(self, core: PolicyCore, r: float, outstanding: int, k: int) -> int:
        p = self.params
        start = min(p.mu, self.mu_max)
        if self.mu_rule == "fixed":
            return start
        # the mu whose recent bursts took least per step; each untried neighbour once
        if self.mu_rule == "learn":
            seen = {m: sum(v[-3:]) / len(v[-3:]) for m, v in self.seconds_per_step.items()}
            if not seen:
                return start
            best = min(seen, key=lambda m: seen[m])
            bursts = sum(len(v) for v in self.seconds_per_step.values())
            for m in (best + 1, best - 1):
                if 1 <= m <= self.mu_max and m not in seen and bursts >= 2:
                    return m
            return best
        # capacity: the largest mu whose dispatch fits overflow x the rollout capacity not held by running executions
        free = (p.K * p.C_e + p.C_s) - core.ledger.running - core.ledger.queued
        best = 1
        for mu in range(1, self.mu_max + 1):
            if r + 1 + (mu - 1) / 2 < mu - 1e-9:  # the depth could not cover such a burst
                break
            if self._dispatch(r, mu, outstanding) * (p.N + k) <= self.overflow * free:
                best = mu
        return best

    def _spares(self, core: PolicyCore) -> int:
        p = self.params
        if p.k_spare == 0 or p.spares == "idle":
            return p.k_spare
        led = core.ledger
        # a group dropped without spares shows one exclusion whatever would have followed: not evidence
        settled = [
            g
            for g in led.groups.values()
            if g.state is not GroupState.OPEN and not (g.state is GroupState.DROPPED and g.n_d == p.N)
        ]
        if len(settled) < 4 * p.B:
            return p.k_spare  # too little seen yet: the configured spares
        rescued = 0
        for g in settled:
            excluded = sum(led.execs[e].status == "excluded" for e in g.execs)
            rescued += 1 <= excluded <= p.k_spare
        return p.k_spare if rescued / len(settled) * p.N > p.k_spare else 0


def make_planner(params: PolicyParams) -> FixedPlanner | AdaptivePlanner:
    return AdaptivePlanner(params) if params.planner == "adaptive" else FixedPlanner(params)
