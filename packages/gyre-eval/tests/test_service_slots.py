"""An assessment whose budget ends while other evaluations hold every evaluation slot settles at its deadline
(unresolved, excluded), not whenever a slot frees: the controller waits for that settlement to replace the execution.
Before, the attempt queued on the slot past its deadline, so a slow judge held other executions' exclusions back for
as long as its own evaluations ran (seen in a `gyre run` with judge tasks)."""

import asyncio

from eval_helpers import run, submission

from gyre_eval.config import ServiceConfig
from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest, Verdict
from gyre_eval.service import AssessmentService
from gyre_eval.store import AssessmentStore


class Held:
    """Scores 1.0 once `release` is set (holding its slot until then); the "short" execution always fails."""

    kind = "held"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.calls: list[str] = []

    def describe(self):
        return {}

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        self.calls.append(request.execution_id)
        if request.execution_id == "short":
            raise EvaluatorError("not valid JSON")
        self.started.set()
        await self.release.wait()
        return Verdict(score=1.0)

    async def aclose(self):
        return None


async def _scenario(tmp_path, workspace):
    held = Held()
    config = ServiceConfig(max_concurrent=1, retry_wait_min_s=0.05, retry_wait_max_s=0.1)
    service = AssessmentService(AssessmentStore(tmp_path / "run"), config, {"task": held})
    try:
        long, _ = service.submit(submission(workspace, "long", budget_s=60.0))
        await held.started.wait()  # the only slot is taken
        short, _ = service.submit(submission(workspace, "short", group_id="g1", budget_s=0.5))
        settled = await asyncio.wait_for(service.wait(short.id), 10)
        still_held = service.store.get(long.id)
        held.release.set()
        done = await service.wait(long.id)
        return settled, still_held, done, service.store.attempts(short.id), held.calls
    finally:
        await service.close()


def test_an_assessment_settles_at_its_deadline_while_every_slot_is_held(tmp_path, workspace):
    settled, still_held, done, attempts, calls = run(_scenario(tmp_path, workspace))
    assert (settled.status, settled.score, settled.final) == ("unresolved", None, True)
    assert settled.resolved_at <= settled.deadline + 1.0  # at its deadline, not when the slot freed
    assert still_held.final is False  # the other evaluation still held the slot then
    assert [a.error for a in attempts] == [
        "EvaluatorError: no evaluation slot was free before the execution's overall budget deadline"
    ]
    assert calls == ["long"]  # the short one's evaluator never ran: no attempt started after its deadline
    assert (done.status, done.score) == ("valid", 1.0)
