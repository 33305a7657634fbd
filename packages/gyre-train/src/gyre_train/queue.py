"""The shared micro-step queue of one batch: cells claim work atomically; the pre-pass makes s_i exact.

Each micro-step enters as a ``prepass`` item (forward only: per-execution partial sums of sg(l_t) - b_t). When the
partial counts of an execution reach its |T_i| (known from packing), its log_ratio_sum is final; a micro-step's
``train`` item is released once every execution it touches is final, carrying those sums in its ExecutionInfo.
Weights are frozen during accumulation, so pre-pass values equal the values the train pass recomputes.
With ``ratio_reference = "proximal"`` no pre-pass is needed: micro-steps enter directly as train items. Single-pass
path (DESIGN §7.2, ``single_pass=True``): a micro-step in which every execution has all its targets inside one shard
also skips the pre-pass; the train forward computes those s_i itself (``gyre_train.loss.ShardLoss``).

``claim`` prefers released train items (oldest first), then pre-pass items. The batch is finished when the stream is
closed and every train item has been reported. All methods are thread-safe (one lock): the core's own worker and the
coordinator thread serving satellites share one queue.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass

from gyre_train.loss import single_pass_ok
from gyre_train.types import ExecutionInfo, MicroStep, PrepassResult, TokenStats, TrainResult, WorkItem


@dataclass(slots=True)
class ExecutionTally:
    """Pre-pass reduction of one execution."""

    info: ExecutionInfo
    log_ratio_sum: float = 0.0
    count: int = 0

    @property
    def final(self) -> bool:
        return self.count == self.info.num_targets


class MicroStepQueue:
    """Work queue of one batch (reopened for every batch)."""

    def __init__(self, prepass: bool = True, single_pass: bool = True) -> None:
        self.prepass = prepass
        self.single_pass = single_pass
        self._lock = threading.Lock()
        self._open(-1)

    def _open(self, batch: int) -> None:
        self.batch = batch
        self._prepass_items: deque[MicroStep] = deque()
        self._train_items: deque[MicroStep] = deque()
        self._in_prepass: dict[int, MicroStep] = {}
        self._waiting: dict[int, MicroStep] = {}
        self._tally: dict[str, ExecutionTally] = {}
        self._closed = False
        self._put = 0
        self._trained = 0
        self._stats = TokenStats()
        self.claims: Counter[int] = Counter()
        self.train_claims: Counter[int] = Counter()

    def open(self, batch: int) -> None:
        with self._lock:
            if self.batch >= 0 and not self._finished_locked():
                raise RuntimeError(f"batch {self.batch} is not finished")
            self._open(batch)

    def put(self, microstep: MicroStep) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the stream of this batch is closed")
            if microstep.batch != self.batch:
                raise ValueError(f"micro-step of batch {microstep.batch} put into batch {self.batch}")
            for e in microstep.executions:
                known = self._tally.setdefault(e.execution_id, ExecutionTally(e))
                if known.info != e:
                    raise ValueError(f"execution {e.execution_id} described differently by two micro-steps")
            self._put += 1
            if self.prepass and not (self.single_pass and single_pass_ok(microstep)):
                self._prepass_items.append(microstep)
            else:
                self._train_items.append(microstep)

    def close(self) -> None:
        """No more micro-steps for this batch."""
        with self._lock:
            self._closed = True

    def claim(self, cell: int) -> WorkItem | None:
        """Atomically hand one item to ``cell`` (None: nothing claimable now; see ``finished``)."""
        with self._lock:
            if self._train_items:
                self.claims[cell] += 1
                self.train_claims[cell] += 1
                return WorkItem(kind="train", microstep=self._train_items.popleft())
            if self._prepass_items:
                self.claims[cell] += 1
                microstep = self._prepass_items.popleft()
                self._in_prepass[microstep.index] = microstep
                return WorkItem(kind="prepass", microstep=microstep)
            return None

    def report_prepass(self, result: PrepassResult) -> None:
        with self._lock:
            self._check_batch(result.batch)
            microstep = self._in_prepass.pop(result.index, None)
            if microstep is None:
                raise ValueError(
                    f"pre-pass result for micro-step {result.index}, which is not being pre-passed"
                )
            for p in result.partials:
                tally = self._tally[p.execution_id]
                tally.log_ratio_sum += p.log_ratio_sum
                tally.count += p.count
                if tally.count > tally.info.num_targets:
                    raise RuntimeError(f"execution {p.execution_id}: more pre-pass targets than |T_i|")
            self._waiting[result.index] = microstep
            self._release_locked()

    def report_train(self, result: TrainResult) -> None:
        with self._lock:
            self._check_batch(result.batch)
            self._trained += 1
            self._stats = self._stats + result.stats
            for p in result.partials:  # single-pass executions: s_i came from the train forward itself
                tally = self._tally[p.execution_id]
                tally.log_ratio_sum += p.log_ratio_sum
                tally.count += p.count

    def _check_batch(self, batch: int) -> None:
        if batch != self.batch:
            raise ValueError(f"result for batch {batch}, the queue is on batch {self.batch}")

    def _release_locked(self) -> None:
        for index in sorted(self._waiting):
            ms = self._waiting[index]
            if all(self._tally[e.execution_id].final for e in ms.executions):
                final = [e.model_copy(update={"log_ratio_sum": self._tally[e.execution_id].log_ratio_sum})
                         for e in ms.executions]  # fmt: skip
                self._train_items.append(ms.model_copy(update={"executions": final}))
                del self._waiting[index]

    def _finished_locked(self) -> bool:
        return self._closed and self._trained == self._put

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._finished_locked()

    @property
    def outstanding(self) -> int:
        """Micro-steps put but not yet trained."""
        with self._lock:
            return self._put - self._trained

    @property
    def unclaimed(self) -> int:
        with self._lock:
            return len(self._prepass_items) + len(self._train_items)

    @property
    def token_stats(self) -> TokenStats:
        with self._lock:
            return self._stats

    def tallies(self) -> dict[str, ExecutionTally]:
        with self._lock:
            return dict(self._tally)
