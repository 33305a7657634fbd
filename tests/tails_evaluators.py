"""gyre-eval plug-in evaluators for the tails run (`tests/test_tails_run.py`), imported by the gyre-eval service of
the run (PYTHONPATH holds this folder).

`TailsEvaluator` fails the first attempt of every execution (an evaluator that is briefly unavailable): the
assessment stays unresolved, then the retry within the budget makes it valid, 1.0 for the answer "mint", else 0.0.
The answer "unscorable" fails every attempt, so that execution is excluded when its overall budget runs out.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest, Verdict

FIRST_FAILURE = "the evaluator is briefly unavailable (first attempt)"
ALWAYS_FAILS = "this answer cannot be scored"


class TailsEvaluator:
    kind = "tails"

    def __init__(self) -> None:
        self._tried: set[str] = set()  # executions whose first attempt already failed (one service process)

    def describe(self) -> dict[str, Any]:
        return {"rule": "1.0 for 'mint'; the first attempt fails; 'unscorable' always fails"}

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        answer = _read_answer(request.workspace / "answer.txt")
        if answer == "unscorable":
            raise EvaluatorError(ALWAYS_FAILS)
        if request.execution_id not in self._tried:
            self._tried.add(request.execution_id)
            raise EvaluatorError(FIRST_FAILURE)
        return Verdict(score=1.0 if answer == "mint" else 0.0)

    async def aclose(self) -> None:
        pass


def _read_answer(path: os.PathLike[str]) -> str:
    """The agent's answer: a regular file, no link followed, at most 1 KiB (the workspace is untrusted)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return f.read(1024).decode(errors="replace").strip()
