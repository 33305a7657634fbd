"""The evaluator contract, as a check any evaluator's own tests can run (built-ins and user plug-ins alike).

    from gyre_eval.contract import check_evaluator
    await check_evaluator(MyEvaluator(...), workspace=path_scored_1, expected_score=1.0)

It fails with an AssertionError naming the broken rule.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from gyre_eval.evaluator import EvaluationRequest, Evaluator, Verdict

# The request carries nothing the score may not depend on: no timing, trajectory or termination data.
ALLOWED_REQUEST_FIELDS = {"execution_id", "workspace", "artifact_version", "branch", "deadline", "task"}


def tree_digest(root: Path) -> str:
    """Digest of names, modes and contents under ``root`` (symlinks by target), to prove nothing changed."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            path = Path(dirpath) / name
            h.update(str(path.relative_to(root)).encode() + b"\0")
            if path.is_symlink():
                h.update(b"L" + os.readlink(path).encode())
            else:
                h.update(oct(path.stat().st_mode).encode() + path.read_bytes())
    return h.hexdigest()


async def check_evaluator(
    evaluator: Evaluator,
    workspace: Path,
    expected_score: float | None = None,
    task: dict | None = None,
    secrets: Sequence[str] = (),
    deadline_s: float = 30.0,
) -> Verdict:
    """Run the contract against one workspace; returns the verdict of the first evaluation."""
    assert isinstance(evaluator, Evaluator), f"{type(evaluator).__name__} lacks kind/describe/evaluate/aclose"
    assert isinstance(evaluator.kind, str) and 0 < len(evaluator.kind) <= 64, "kind must be a short string"
    described = json.dumps(evaluator.describe())  # raises if not JSON-serializable
    for secret in secrets:
        assert secret not in described, "describe() leaks a secret into provenance"
    assert {f.name for f in fields(EvaluationRequest)} == ALLOWED_REQUEST_FIELDS, "request fields changed"

    before = tree_digest(workspace)
    deadline = time.time() + deadline_s
    request = EvaluationRequest(
        execution_id="contract-1",
        workspace=workspace,
        artifact_version="v1",
        branch="main",
        deadline=deadline,
        task=task or {},
    )
    first = await evaluator.evaluate(request)
    assert time.time() <= deadline + 1.0, "evaluate ran past its deadline"
    assert isinstance(first, Verdict), f"evaluate returned {type(first).__name__}, not a Verdict"
    assert isinstance(first.score, int | float) and not isinstance(first.score, bool), (
        "score must be a number"
    )
    assert first.score == first.score and abs(first.score) != float("inf"), "score must be finite"
    json.dumps(first.details, default=str)
    if expected_score is not None:
        assert abs(first.score - expected_score) < 1e-9, f"score {first.score} != expected {expected_score}"
    assert tree_digest(workspace) == before, "the evaluator modified the preserved workspace"

    # Same preserved state, different execution identity and a later deadline: same score.
    again = await evaluator.evaluate(
        EvaluationRequest(
            execution_id="contract-2",
            workspace=workspace,
            artifact_version="v1",
            branch="main",
            deadline=time.time() + deadline_s,
            task=task or {},
        )
    )
    assert again.score == first.score, f"same state scored {first.score} then {again.score}"
    assert tree_digest(workspace) == before, "the evaluator modified the preserved workspace"

    # A missing workspace is a failure (raise), never a score.
    missing = workspace.parent / (workspace.name + "-missing-contract")
    try:
        verdict = await evaluator.evaluate(
            EvaluationRequest(
                execution_id="contract-3",
                workspace=missing,
                artifact_version="v1",
                branch="main",
                deadline=time.time() + deadline_s,
                task=task or {},
            )
        )
    except Exception:
        pass
    else:
        raise AssertionError(f"a missing workspace must raise, not score {verdict.score}")
    return first
