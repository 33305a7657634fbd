"""Lower bounds on a run's end-to-end time, and the reference run that launches in dispatch order.

``ideal_bound(cfg)``: the ideal bound of boundary dispatch, only dispatch's tail is left. ``ideal_config(cfg)`` is the
same run (workload, seed, N, B, phi, mu, spares, planner) with unlimited rollout capacity and free training: one
training cell that trains a group in no time, a standalone pool that launches every execution the moment it is
dispatched, no switch, optimizer, broadcast, publication or reroute cost. A step then ends the moment its B-th group is
ready, and a burst's dispatch waits only for the burst's last step: what remains is the time groups take to become
ready (their longest execution plus evaluation) under boundary dispatch. No policy on the real cluster can be faster on
the same executions, up to the order in which refills take plans.

``capacity_bound(cfg)``: the ideal bound plus the cluster's finite rollout slots (see its docstring). It holds for any
schedule, clairvoyant ones included (one that knows every duration and launches in the best order), so it is what no
policy can beat, not what a policy that cannot see durations reaches.

``dispatch_order_reference(cfg)``: a real schedule, not a bound: the same run with every slot rolling out all the time,
free training and switching, and launches in dispatch order (eq. 4's queue). It is what a policy whose role decisions
cost nothing would reach with the launch order every policy here uses; the distance from it to the capacity bound is
what a launch order that knew durations could still gain (``longest_first=True`` is such an order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre_sched.config import SimConfig
from gyre_sched.sim import SimResult, Simulator
from gyre_sched.workload import make_workload

_FREE = (
    "pipeline_startup_s",
    "pipeline_drain_s",
    "optimizer_s",
    "broadcast_s",
    "switch_to_training_s",
    "switch_to_rollout_s",
    "satellite_join_s",
    "publish_s",
    "reroute_penalty_s",
)


def _free_training(cfg: SimConfig, name: str) -> dict[str, Any]:
    d: dict[str, Any] = cfg.model_dump()
    d["name"] = f"{cfg.name}-{name}"
    d["policy"].update(kind="async", async_train_cells=1, streaming=True)
    d["cost"].update(
        {k: 0.0 for k in _FREE},
        train_node_s_per_group=1e-9,
        microsteps_per_group=1,
        microstep_overhead_s=0.0,
        warmup_s=0.0,
    )
    d["workload"]["cancel_latency_s"] = 0.0
    return d


def ideal_config(cfg: SimConfig) -> SimConfig:
    """``cfg`` with unlimited capacity and free training (see module docstring)."""
    d = _free_training(cfg, "bound")
    d["cluster"].update(nodes=d["cluster"]["nodes_per_cell"], standalone_nodes=0, C_s=10**9)
    return SimConfig.model_validate(d)


def ideal_bound(cfg: SimConfig) -> SimResult:
    """Simulate the ideal bound of ``cfg``."""
    return Simulator(ideal_config(cfg)).run()


def rollout_slots(cfg: SimConfig) -> int:
    """Every slot of the cluster: K * C_e + C_s (eq. 3 with no cell away from rollout)."""
    p = cfg.policy_params()
    return p.K * p.C_e + p.C_s


def dispatch_order_config(cfg: SimConfig) -> SimConfig:
    """``cfg`` with free training on a cell of its own and all ``rollout_slots(cfg)`` in a pool that never leaves
    rollout; launches keep eq. 4's queue order (see module docstring)."""
    d = _free_training(cfg, "dispatch-order")
    d["cluster"].update(nodes=d["cluster"]["nodes_per_cell"], standalone_nodes=0, C_s=rollout_slots(cfg))
    return SimConfig.model_validate(d)


def dispatch_order_reference(cfg: SimConfig, *, longest_first: bool = False) -> SimResult:
    """Simulate ``dispatch_order_config(cfg)``: a schedule, so never below ``capacity_bound(cfg)``.

    ``longest_first``: the clairvoyant variant; each dispatch re-sorts the launch queue by the executions' planned
    durations, longest first (no real policy knows them). How close it comes to the capacity bound shows how tight
    the bound is."""
    sim = Simulator(dispatch_order_config(cfg))
    if longest_first:
        led, wl = sim.policy.ledger, sim.workload
        led.launch_key = lambda e: -wl.plan(led.groups[e.group].seq, e.index).duration_s
    return sim.run()


@dataclass(frozen=True, slots=True)
class CapacityBound:
    end_time_s: float
    """max(ideal_s, capacity_s): no schedule of these executions on this cluster finishes its last step earlier."""
    ideal_s: float
    """``ideal_bound(cfg).end_time_s``."""
    capacity_s: float
    """The slot-work and dispatch-tail constraints of ``capacity_bound`` alone, chained over bursts."""
    slots: int
    step_s: list[float] = field(repr=False)
    """Per step k (1..S), the chained lower bound on when step k can end (``capacity_s`` is the last)."""


def group_demands(cfg: SimConfig, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ``groups`` groups that can become ready, in group order: ``(seq, work_s, ready_s)``.

    Which executions a group needs depends only on its plans (never on timing): the first N whose plan is not
    excluded, in dispatch-index order, and every excluded one before them (its exclusion must be known). A group is
    dropped exactly when the N-th such execution lies beyond its N + k_spare. ``work_s`` sums the needed executions'
    durations (slot-seconds they hold, at least); ``ready_s`` is launch to readiness at best: the largest needed
    duration plus assessment."""
    p = cfg.policy_params()
    wl = make_workload(cfg.workload, cfg.seed)
    seqs, work, ready = [], [], []
    seq = 0
    while len(seqs) < groups:
        need, w, r = 0, 0.0, 0.0
        for i in range(p.N_d):
            plan = wl.plan(seq, i)
            w += plan.duration_s
            r = max(r, plan.duration_s + plan.assess_delay_s)
            if plan.status != "excluded":
                need += 1
                if need == p.N:
                    break
        if need == p.N:
            seqs.append(seq)
            work.append(w)
            ready.append(r)
        seq += 1
        if seq > 10 * groups + 1000:
            raise ValueError(
                f"capacity bound: fewer than {groups} of the first {seq} groups can become ready"
            )
    return np.array(seqs), np.array(work), np.array(ready)


def capacity_bound(cfg: SimConfig) -> CapacityBound:
    """A lower bound on the end of step S (``cfg.steps``) for any schedule of ``cfg``'s executions on its cluster,
    with free training and switching: ``max(ideal_bound, chained capacity constraints)``.

    Boundary dispatch, fixed planner: burst b >= 1 dispatches mu*B groups at its publication P_b >= T_{b mu} (T_k: when
    step k ends), burst 0 (phi + mu)*B at t = 0; a dropped group is refilled at once. Why it holds, for every schedule:

    1. Slots: at most ``rollout_slots(cfg)`` = C executions run at once (eq. 3 with no cell training), and a group's
       needed executions (``group_demands``) each run their whole duration after its dispatch; readiness comes at the
       earliest ``ready_s`` after dispatch.
    2. Leftover: groups dispatched before P_b that are never dropped number at most D_b = phi*B + b*mu*B (every drop
       adds one refill); steps 1..b*mu consumed b*mu*B of them, so at most phi*B are left for later steps. Hence of
       the (k - b*mu)*B groups steps b*mu+1..k consume, m = (k - b*mu)*B - phi*B (m = k*B for b = 0) were dispatched at
       or after P_b, ran all their needed executions within [T_{b mu}, T_k] and became ready by T_k:
       T_k - T_{b mu} >= max(sum of their work / C, the largest of their ready_s).
    3. Which groups: numbering groups in dispatch order, one dispatched at or after P_b has number >= D_b; one
       dispatched before T_k (a step consumes only groups dispatched before it ends) is among the first
       D_{(k-1)//mu + 1} groups that are never dropped (same counting). Whatever the schedule picks among those
       candidates costs at least the m smallest works' sum and the m-th smallest ready_s.
    4. Chaining: T_k >= max over bursts b with b*mu < k of (bound on T_{b mu} + the constraint of 2.), T_0 = 0, and
       T_k >= T_{k-1}.

    Every constraint holds for any launch order, so a schedule that knew durations is bounded too. The ideal bound
    (itself exact up to the order in which refills take plans) adds dispatch's tail per group. Raises ValueError for
    continuous dispatch or the adaptive planner (their dispatch is not fixed in advance)."""
    p = cfg.policy_params()
    if p.dispatch != "boundary" or p.planner != "fixed":
        raise ValueError(
            f"capacity_bound needs boundary dispatch with the fixed planner (dispatch={p.dispatch}, "
            f"planner={p.planner})"
        )
    S, mu, B, phiB = cfg.steps, p.mu, p.B, p.phi_B
    C = rollout_slots(cfg)

    def dispatched_before(b: int) -> int:  # D_b: groups bursts 0..b-1 dispatch
        return 0 if b == 0 else phiB + b * mu * B

    last_burst = (S - 1) // mu
    seqs, work, ready = group_demands(cfg, dispatched_before(last_burst + 1))
    lo = [int(np.searchsorted(seqs, dispatched_before(b))) for b in range(last_burst + 1)]
    T = [0.0] * (S + 1)
    for k in range(1, S + 1):
        hi = dispatched_before((k - 1) // mu + 1)
        best = 0.0
        for b in range((k - 1) // mu + 1):
            m = (k - b * mu) * B - (phiB if b else 0)
            if m <= 0:
                continue
            w, r = work[lo[b] : hi], ready[lo[b] : hi]
            if m > len(w):
                raise AssertionError(f"capacity bound: {m} groups needed from {len(w)} candidates")
            span = max(float(np.partition(w, m - 1)[:m].sum()) / C, float(np.partition(r, m - 1)[m - 1]))
            best = max(best, T[b * mu] + span)
        T[k] = max(best, T[k - 1])  # steps end in order
    ideal = ideal_bound(cfg).end_time_s
    return CapacityBound(max(ideal, T[S]), ideal, T[S], C, T[1:])
