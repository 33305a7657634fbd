"""The shared micro-step queue of one batch: cells claim work atomically; the pre-pass makes s_i exact.

Each micro-step enters as a ``prepass`` item (forward only: per-execution partial sums of sg(l_t) - b_t). When the
partial counts of an execution reach its |T_i| (known from packing), its log_ratio_sum is final; a micro-step's
``train`` item is released once every execution it touches is final, carrying those sums in its ExecutionInfo.
Weights are frozen during accumulation, so pre-pass values equal the values the train pass recomputes.
With ``ratio_reference = "proximal"`` no pre-pass is needed: micro-steps enter directly as train items. Single-pass
path (docs/design/training.md#objective, ``single_pass=True``): a micro-step in which every execution has all its targets inside one shard
also skips the pre-pass; the train forward computes those s_i itself (``gyre_train.loss.ShardLoss``).

``claim`` prefers released train items (oldest first), then pre-pass items. The batch is finished when the stream is
closed and every train item has been reported. All methods are thread-safe (one lock): the core's own worker and the
coordinator thread serving satellites share one queue.

Lost cells (``drop_cell``): the queue records which cell holds each claim and which cell trained each micro-step. A
dropped cell's claimed-but-unreported items (pre-pass and train) go back to the front of their queues, and so do
the train items it already reported: their gradients live only in that cell's backend, which is not summed. Its
reported pre-pass partials stay (they are values held here). A report is accepted only from the cell that holds the
claim, so a late report of a requeued item is refused (``LateReport``) and nothing is counted twice.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass

from gyre_train.errors import LateReport
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
        self._in_prepass: dict[int, tuple[int, MicroStep]] = {}  # index -> (claiming cell, micro-step)
        self._in_train: dict[int, tuple[int, MicroStep]] = {}
        self._trained: dict[int, tuple[MicroStep, TrainResult]] = {}  # index -> (train item, its result)
        self._waiting: dict[int, MicroStep] = {}
        self._tally: dict[str, ExecutionTally] = {}
        self._closed = False
        self._put = 0
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
                microstep = self._train_items.popleft()
                self._in_train[microstep.index] = (cell, microstep)
                return WorkItem(kind="train", microstep=microstep)
            if self._prepass_items:
                self.claims[cell] += 1
                microstep = self._prepass_items.popleft()
                self._in_prepass[microstep.index] = (cell, microstep)
                return WorkItem(kind="prepass", microstep=microstep)
            return None

    def drop_cell(self, cell: int) -> list[WorkItem]:
        """Requeue everything whose result depends on ``cell``'s state; returns the requeued items.

        Claimed-but-unreported pre-pass and train items, and train items ``cell`` already reported (their gradient
        stays in the dropped cell). Requeued items go to the front (oldest first); later reports from ``cell``
        for them are refused.
        """
        with self._lock:
            prepass = sorted(i for i, (c, _) in self._in_prepass.items() if c == cell)
            train = sorted(i for i, (c, _) in self._in_train.items() if c == cell)
            trained = sorted(i for i, (_, r) in self._trained.items() if r.cell == cell)
            back_prepass = [self._in_prepass.pop(i)[1] for i in prepass]
            back_train = [self._in_train.pop(i)[1] for i in train]
            back_train += [self._trained.pop(i)[0] for i in trained]
            back_train.sort(key=lambda ms: ms.index)
            self._prepass_items.extendleft(reversed(back_prepass))
            self._train_items.extendleft(reversed(back_train))
            return [WorkItem(kind="prepass", microstep=m) for m in back_prepass] + [
                WorkItem(kind="train", microstep=m) for m in back_train
            ]

    def report_prepass(self, result: PrepassResult) -> None:
        with self._lock:
            self._check_batch(result.batch)
            holder = self._in_prepass.get(result.index)
            if holder is None:
                raise LateReport(
                    f"pre-pass result for micro-step {result.index}, which is not being pre-passed"
                )
            if holder[0] != result.cell:
                raise LateReport(
                    f"pre-pass result for micro-step {result.index} from cell {result.cell}; "
                    f"cell {holder[0]} holds it (requeued)"
                )
            microstep = self._in_prepass.pop(result.index)[1]
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
            holder = self._in_train.get(result.index)
            if holder is None or holder[0] != result.cell:
                who = "nobody" if holder is None else f"cell {holder[0]}"
                raise LateReport(
                    f"train result for micro-step {result.index} from cell {result.cell}; {who} holds it"
                )
            self._trained[result.index] = (self._in_train.pop(result.index)[1], result)

    def _check_batch(self, batch: int) -> None:
        if batch != self.batch:
            raise ValueError(f"result for batch {batch}, the queue is on batch {self.batch}")

    def _release_locked(self) -> None:
        for index in sorted(self._waiting):
            ms = self._waiting[index]
            if all(self._tally[e.execution_id].final for e in ms.executions):
                final = [
                    e.model_copy(update={"log_ratio_sum": self._tally[e.execution_id].log_ratio_sum})
                    for e in ms.executions
                ]
                self._train_items.append(ms.model_copy(update={"executions": final}))
                del self._waiting[index]

    def _finished_locked(self) -> bool:
        return self._closed and len(self._trained) == self._put

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._finished_locked()

    @property
    def outstanding(self) -> int:
        """Micro-steps put but not yet trained."""
        with self._lock:
            return self._put - len(self._trained)

    @property
    def unclaimed(self) -> int:
        with self._lock:
            return len(self._prepass_items) + len(self._train_items)

    @property
    def token_stats(self) -> TokenStats:
        """Sum over the accepted train results (micro-step order)."""
        with self._lock:
            stats = TokenStats()
            for index in sorted(self._trained):
                stats = stats + self._trained[index][1].stats
            return stats

    def trained_items(self) -> list[MicroStep]:
        """The accepted train items of the batch as they were trained (final ExecutionInfo), by index."""
        with self._lock:
            return [self._trained[index][0] for index in sorted(self._trained)]

    @property
    def trained_by_cell(self) -> Counter[int]:
        """Accepted train results per cell (a dropped cell's results are not counted)."""
        with self._lock:
            return Counter(r.cell for _, r in self._trained.values())

    def tallies(self) -> dict[str, ExecutionTally]:
        """Per-execution sums: pre-pass reports plus single-pass partials of the accepted train results."""
        with self._lock:
            out = {k: ExecutionTally(t.info, t.log_ratio_sum, t.count) for k, t in self._tally.items()}
            for index in sorted(self._trained):
                for p in self._trained[index][1].partials:  # single-pass: s_i came from the train forward
                    out[p.execution_id].log_ratio_sum += p.log_ratio_sum
                    out[p.execution_id].count += p.count
            return out
