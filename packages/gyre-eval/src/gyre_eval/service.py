"""The reward service core: accept submissions, evaluate with retries inside the budget, settle each assessment once.

Life of an assessment:
- ``no_work`` at once when the execution left nothing to assess (no artifact, or a declared complete failure);
- ``unresolved`` and final at once when the overall budget (from launch) has already expired: excluded, never zero;
- otherwise ``unresolved`` while attempts run against the same preserved state (tenacity, exponential backoff). The
  first successful attempt makes it ``valid`` with its score (a zero stays a valid zero). When the next attempt could
  only start after the deadline, it settles ``unresolved``: the execution is excluded from training.
Every attempt is appended to the store before the next one starts, and unfinished assessments are resumed when the
service starts, so a restart in the middle of an evaluation loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from gyre_eval.config import ServiceConfig, build_evaluator
from gyre_eval.errors import ArtifactOutsideRootsError, EvaluatorError, UnknownEvaluatorError
from gyre_eval.evaluator import EvaluationRequest, Evaluator, Verdict
from gyre_eval.groups import group_status
from gyre_eval.store import AssessmentStore, assessment_id
from gyre_eval.types import (
    AdvantageMode,
    Assessment,
    AttemptRecord,
    GroupState,
    GroupStatus,
    Provenance,
    Submission,
)

log = logging.getLogger(__name__)


class AssessmentService:
    """Owns the store and the evaluators; one instance per run directory."""

    def __init__(
        self,
        store: AssessmentStore,
        config: ServiceConfig,
        evaluators: dict[str, Evaluator] | None = None,
        clock: Callable[[], float] = time.time,
        on_settled: Callable[[Assessment], None] | None = None,
    ) -> None:
        self.store = store
        self.on_settled = on_settled
        """Called with every assessment when it becomes final (e.g. to emit ``assessed`` / ``group_*`` events)."""
        self.config = config
        self.evaluators = (
            evaluators
            if evaluators is not None
            else {name: build_evaluator(spec) for name, spec in config.evaluators.items()}
        )
        self.clock = clock
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> int:
        """Resume every assessment a previous process left unfinished; returns how many."""
        unfinished = self.store.unfinished()
        for aid in unfinished:
            self._schedule(aid)
        return len(unfinished)

    async def close(self) -> None:
        """Stop evaluating (unfinished assessments stay unfinished and resume on the next start)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for evaluator in self.evaluators.values():
            await evaluator.aclose()

    async def wait(self, aid: str) -> Assessment:
        """Wait until the assessment is final (in-process users and tests)."""
        task = self._tasks.get(aid)
        if task is not None:
            await asyncio.shield(task)
        found = self.store.get(aid)
        if found is None:
            raise KeyError(aid)
        return found

    # -- submissions --------------------------------------------------------------------------------------------

    def _check_artifact_root(self, ref: str | None) -> None:
        roots = self.config.artifact_roots
        if ref is None or roots is None:
            return
        try:
            target = Path(ref).resolve()
        except (OSError, RuntimeError) as e:
            raise ArtifactOutsideRootsError(f"artifact_ref: {e}") from None
        if not any(target.is_relative_to(Path(r).resolve()) for r in roots):
            raise ArtifactOutsideRootsError(
                f"artifact_ref {ref[:300]!r} resolves outside the service's artifact roots {roots}"
            )

    def submit(self, sub: Submission) -> tuple[Assessment, bool]:
        """Record ``sub`` (idempotent) and start evaluating it; returns the assessment and whether it is new."""
        now = self.clock()
        if self.store.get(assessment_id(sub.execution_id, sub.branch, sub.artifact_version, sub.evaluator)):
            # Known key: the store returns it unchanged or reports a conflict; nothing is re-decided.
            return self.store.submit(sub, "unresolved", None, False, Provenance(evaluator="", kind=""), now)
        self._check_artifact_root(sub.artifact_ref)
        describe: dict[str, Any] = {}
        no_work = sub.no_work_reason
        if no_work is None and sub.artifact_ref is None:
            no_work = "the execution left no artifact"
        if no_work is None and not Path(sub.artifact_ref or "").is_dir():
            no_work = f"no workspace at {sub.artifact_ref}"
        if no_work is None:
            evaluator = self.evaluators.get(sub.evaluator)
            if evaluator is None:
                raise UnknownEvaluatorError(
                    f"unknown evaluator {sub.evaluator!r}; configured: {sorted(self.evaluators) or 'none'}"
                )
            describe = evaluator.describe()
        if no_work is not None:
            prov = Provenance(
                evaluator=sub.evaluator,
                kind="service",
                outcome=sub.outcome,
                details={"no_work_reason": no_work},
            )
            return self._settled(*self.store.submit(sub, "no_work", 0.0, True, prov, now))
        kind = self.evaluators[sub.evaluator].kind
        if now >= sub.deadline:
            prov = Provenance(
                evaluator=sub.evaluator,
                kind=kind,
                describe=describe,
                outcome=sub.outcome,
                last_error="overall budget expired before the assessment could start",
            )
            return self._settled(*self.store.submit(sub, "unresolved", None, True, prov, now))
        prov = Provenance(evaluator=sub.evaluator, kind=kind, describe=describe, outcome=sub.outcome)
        assessment, created = self.store.submit(sub, "unresolved", None, False, prov, now)
        if not assessment.final:
            self._schedule(assessment.id)
        return assessment, created

    def _settled(self, assessment: Assessment, created: bool = True) -> tuple[Assessment, bool]:
        if self.on_settled is not None and created and assessment.final:
            try:
                self.on_settled(assessment)
            except Exception:  # a listener's bug must not lose or block an assessment
                log.exception("on_settled listener failed for %s", assessment.id)
        return assessment, created

    def _schedule(self, aid: str) -> None:
        if aid in self._tasks:
            return
        task = asyncio.get_running_loop().create_task(self._evaluate(aid), name=f"assess:{aid}")
        self._tasks[aid] = task
        task.add_done_callback(lambda _t: self._tasks.pop(aid, None))

    # -- evaluation ---------------------------------------------------------------------------------------------

    async def _evaluate(self, aid: str) -> None:
        sub = self.store.submission(aid)
        current = self.store.get(aid)
        assert current is not None
        number = current.attempts
        provenance = current.provenance
        request = EvaluationRequest(
            execution_id=sub.execution_id,
            workspace=Path(sub.artifact_ref or ""),
            artifact_version=sub.artifact_version,
            branch=sub.branch,
            deadline=sub.deadline,
            task=sub.task,
        )
        retrying = AsyncRetrying(
            stop=lambda rs: self._next_start_too_late(rs, sub.deadline),
            wait=wait_exponential(
                multiplier=self.config.retry_wait_min_s,
                min=self.config.retry_wait_min_s,
                max=self.config.retry_wait_max_s,
            ),
            # any evaluator exception is a failure; cancellation is not
            retry=retry_if_exception_type(Exception),
            reraise=True,
        )
        verdict: Verdict | None = None
        try:
            if self.clock() < sub.deadline:
                async for attempt in retrying:
                    with attempt:
                        number += 1
                        verdict, provenance = await self._attempt(aid, number, sub, request, provenance)
        except Exception as e:
            log.info("assessment %s unresolved after %d attempts: %s", aid, number, e)
        stored = self.store.get(aid)
        assert stored is not None
        provenance = stored.provenance  # holds the last attempt's error
        if verdict is None:
            last = provenance.last_error or "overall budget expired"
            provenance = provenance.model_copy(update={"last_error": f"budget expired; last failure: {last}"})
            self._settled(self.store.finalize(aid, "unresolved", None, provenance, self.clock()))
            return
        provenance = provenance.model_copy(
            update={"critique": verdict.critique, "details": verdict.details, "last_error": None}
        )
        self._settled(self.store.finalize(aid, "valid", verdict.score, provenance, self.clock()))

    def _next_start_too_late(self, rs: RetryCallState, deadline: float) -> bool:
        return self.clock() + (rs.upcoming_sleep or 0.0) >= deadline

    @contextlib.asynccontextmanager
    async def _slot(self, deadline: float):
        """One of `max_concurrent` evaluation slots, waited for until `deadline` at most (yields False then): an
        assessment whose budget ends while other evaluations hold every slot settles at its deadline, not whenever
        a slot frees (the controller waits for it to replace the execution)."""
        acquired = True
        if not self._slots.locked():
            await self._slots.acquire()
        else:
            try:
                await asyncio.wait_for(self._slots.acquire(), max(0.0, deadline - self.clock()))
            except TimeoutError:
                acquired = False
        try:
            yield acquired
        finally:
            if acquired:
                self._slots.release()

    async def _attempt(
        self, aid: str, number: int, sub: Submission, request: EvaluationRequest, provenance: Provenance
    ) -> tuple[Verdict, Provenance]:
        async with self._slot(sub.deadline) as slot:
            started = self.clock()
            error: Exception | None = None
            verdict: Verdict | None = None
            try:
                if not slot:
                    raise EvaluatorError(
                        "no evaluation slot was free before the execution's overall budget deadline"
                    )
                evaluator = self.evaluators.get(sub.evaluator)
                if evaluator is None:
                    raise UnknownEvaluatorError(f"evaluator {sub.evaluator!r} is no longer configured")
                # The deadline binds every evaluator, including plug-ins that ignore it.
                try:
                    verdict = await asyncio.wait_for(evaluator.evaluate(request), sub.deadline - self.clock())
                except TimeoutError as e:
                    raise EvaluatorError("attempt cut off at the execution's overall budget deadline") from e
                _check_verdict(verdict)
            except Exception as e:
                error = e
            finished = self.clock()
        message = None if error is None else f"{type(error).__name__}: {error}"[:2000]
        details = verdict.details if verdict is not None else {}
        self.store.record_attempt(
            AttemptRecord(
                assessment_id=aid,
                number=number,
                started_at=started,
                finished_at=finished,
                ok=error is None,
                score=verdict.score if verdict else None,
                error=message,
                details=details,
            ),
            provenance.model_copy(update={"last_error": message}),
        )
        if error is not None:
            raise error
        assert verdict is not None
        return verdict, provenance

    # -- groups -------------------------------------------------------------------------------------------------

    def group(self, group_id: str, mode: AdvantageMode | None = None) -> GroupStatus | None:
        shape = self.store.group(group_id)
        if shape is None:
            return None
        designated = self.store.list(group_id=group_id, designated=True, limit=1_000_000)
        return group_status(group_id, shape[0], shape[1], designated, mode or self.config.advantage_mode)

    def groups(self, state: GroupState | None = None, mode: AdvantageMode | None = None) -> list[GroupStatus]:
        found = [self.group(gid, mode) for gid in self.store.group_ids()]
        return [g for g in found if g is not None and (state is None or g.state == state)]


def _check_verdict(verdict: Any) -> None:
    if not isinstance(verdict, Verdict):
        raise TypeError(f"evaluator returned {type(verdict).__name__}, not a Verdict")
    if (
        isinstance(verdict.score, bool)
        or not isinstance(verdict.score, int | float)
        or not math.isfinite(verdict.score)
    ):
        raise ValueError(f"evaluator returned a non-finite or non-numeric score {verdict.score!r}")
