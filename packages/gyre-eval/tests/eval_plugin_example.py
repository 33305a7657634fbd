"""An example user plug-in: scores the fraction of required files present in the workspace.

Loaded by reference, exactly as a user's would be: ``{"kind": "plugin", "factory":
"eval_plugin_example:RequiredFiles", "options": {"required": ["a.py", "b.py"]}}``.
"""

from __future__ import annotations

from typing import Any

from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest, Verdict


class RequiredFiles:
    kind = "required-files"

    def __init__(self, required: list[str]) -> None:
        self.required = list(required)

    def describe(self) -> dict[str, Any]:
        return {"required": self.required, "version": 1}

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        if not request.workspace.is_dir():
            raise EvaluatorError(f"no workspace at {request.workspace}")
        present = [name for name in self.required if (request.workspace / name).is_file()]
        missing = sorted(set(self.required) - set(present))
        critique = f"missing: {', '.join(missing)}" if missing else "all required files present"
        return Verdict(
            score=len(present) / len(self.required), critique=critique, details={"present": present}
        )

    async def aclose(self) -> None:
        return None
