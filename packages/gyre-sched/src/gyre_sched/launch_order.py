"""Predicted launch order (``launch_order = "predicted"``): queries that ran longest before launch first.

With boundary dispatch a burst's executions queue in dispatch order, so the long ones that happen to be dispatched
late start in the second wave and set the burst's tail. Launching the longest first closes most of that gap (the
clairvoyant reference of ``gyre_sched.bound`` comes within 0.5% of the capacity bound), but no real policy knows an
execution's duration. What a real run does know: a dataset's queries recur across epochs, and a query's executions
took about as long the last time (hard tasks stay hard, broken environments stay broken).

``DurationPredictor`` learns only from what the policy itself sees: when it launched an execution (its own clock at
the Launch decision), when the execution terminated (the Terminated event) and of which query it was. Cancelled
executions are censored (stopped before their end) and not counted. A query never observed gets the prior: the mean
of every observed duration so far (0 before any), so it ranks between known-long and known-short queries.

The predictor only reorders the launch queue. Which executions a group counts (the first N non-excluded by dispatch
index), dispatch, and eq. 2's accounting are untouched; refills and promoted spares keep their priority.
"""

from __future__ import annotations

from gyre_sched.ledger import Execution, Ledger
from gyre_sched.types import Outcome


class DurationPredictor:
    """Per-query mean of observed durations (launch to termination), with the running mean as the prior."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._n: dict[str, int] = {}
        self._total = 0.0
        self._count = 0
        self._running: dict[str, tuple[str, float]] = {}  # execution -> (query, launch time)

    def launched(self, eid: str, query: str, now: float) -> None:
        self._running[eid] = (query, now)

    def terminated(self, eid: str, outcome: Outcome, now: float) -> None:
        got = self._running.pop(eid, None)
        if got is None or outcome == "cancelled":  # censored: it would have run longer
            return
        query, t0 = got
        d = now - t0
        self._sum[query] = self._sum.get(query, 0.0) + d
        self._n[query] = self._n.get(query, 0) + 1
        self._total += d
        self._count += 1

    def observed(self, query: str) -> int:
        """Terminations of ``query`` observed so far."""
        return self._n.get(query, 0)

    def predict(self, query: str) -> float:
        n = self._n.get(query, 0)
        if n:
            return self._sum[query] / n
        return self._total / self._count if self._count else 0.0


def install(ledger: Ledger, predictor: DurationPredictor) -> None:
    """Make ``ledger`` launch refills and promoted spares first (as in dispatch order), then the executions of the
    queries predicted longest; ties keep dispatch order (the ledger's sort is stable)."""

    def key(e: Execution) -> tuple[int, float]:
        return (0 if ledger.prioritized(e) else 1, -predictor.predict(ledger.groups[e.group].query))

    ledger.launch_key = key
