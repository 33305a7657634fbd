"""The evaluator half of a workload definition played in a real run (`gyre_sched.workload_harness` plays the
executions): each attempt takes the latency the workload drew for it and fails where the workload drew a failure, so
gyre-eval's retries, budgets and exclusions in the real run follow the same plan as in the simulator.

A plug-in evaluator (`"scoring": {"kind": "python", "factory": "gyre_eval.workload:WorkloadEvaluator", "options":
{"workload": "WORKLOAD.json", "seed": S}}`). The score is a draw of its own per execution, uniform in [0, 1] and
rounded to a tenth: the rewards of a group differ, so advantages are not all zero; the workload does not model what
the policy learns.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest, Verdict

__all__ = ["WorkloadEvaluator"]


class WorkloadEvaluator:
    kind = "workload"

    def __init__(self, workload: str, seed: int) -> None:
        from gyre_sched.workload_harness import load_workload  # gyre-sched is gyre-eval's dependency already

        self.path, self.seed = workload, int(seed)
        self.workload = load_workload(workload)
        self._attempts: dict[str, int] = {}  # attempts made per execution, in this service process

    def describe(self) -> dict[str, Any]:
        return {"workload": self.path, "seed": self.seed}

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        from gyre_sched.workload_harness import execution_of, plan_of

        plan = plan_of(self.workload, self.seed, request.execution_id)
        number = self._attempts[request.execution_id] = self._attempts.get(request.execution_id, 0) + 1
        latency, succeeded = plan.evaluation[number - 1] if number <= len(plan.evaluation) else (0.0, True)
        # the evaluator's drawn latency (wall time: this evaluator plays a workload)
        await asyncio.sleep(latency)
        if not succeeded:
            raise EvaluatorError(f"the workload drew a failure for attempt {number}")
        group, index = execution_of(request.execution_id)
        score = round(random.Random(f"reward/{self.seed}/{group}/{index}").random(), 1)
        return Verdict(score=score, details={"attempt": number})

    async def aclose(self) -> None:
        pass
