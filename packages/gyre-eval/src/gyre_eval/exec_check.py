"""Built-in evaluator: an executable check run in the sandbox against a private copy of the preserved workspace."""

from __future__ import annotations

import math
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gyre_eval.errors import EvaluatorError, SandboxError
from gyre_eval.evaluator import EvaluationRequest, Verdict
from gyre_eval.sandbox import Sandbox, SandboxConfig


class ExecCheckConfig(BaseModel):
    """An executable check: a command whose exit code or score file is the score."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["exec"] = "exec"
    command: list[str] = Field(min_length=1)
    """argv run in the private copy (cwd); $GYRE_WORKSPACE and $GYRE_SCORE_FILE are set."""
    score_from: Literal["exit_code", "score_file"] = "exit_code"
    """exit_code: a pass code scores 1.0, a fail code 0.0. score_file: the number written to $GYRE_SCORE_FILE."""
    pass_codes: list[int] = Field(default_factory=lambda: [0])
    """Exit codes meaning the check ran and passed."""
    fail_codes: list[int] = Field(default_factory=lambda: [1])
    """Exit codes meaning the check ran and the artifact failed (a valid zero). Any other code is an evaluator failure."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

    @field_validator("fail_codes")
    @classmethod
    def _disjoint(cls, v: list[int], info: Any) -> list[int]:
        overlap = set(v) & set(info.data.get("pass_codes", []))
        if overlap:
            raise ValueError(f"exit codes {sorted(overlap)} are both pass and fail codes")
        return v


class ExecutableCheck:
    """Runs ``config.command`` sandboxed; a crash, signal, unknown exit code, timeout, bad score file, or a total limit
    of the sandbox broken (memory, disk, processes) is a failure."""

    kind = "exec"

    def __init__(self, config: ExecCheckConfig) -> None:
        self.config = config
        self.sandbox = Sandbox(config.sandbox)

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "command": cfg.command,
            "score_from": cfg.score_from,
            "pass_codes": cfg.pass_codes,
            "fail_codes": cfg.fail_codes,
            "timeout_s": cfg.sandbox.timeout_s,
        }

    async def aclose(self) -> None:
        return None

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        if not request.workspace.is_dir():
            raise EvaluatorError(f"workspace {request.workspace} is not a directory")
        try:
            result = await self.sandbox.run(self.config.command, request.workspace, deadline=request.deadline)
        except SandboxError as e:
            raise EvaluatorError(str(e)) from e
        details: dict[str, Any] = {
            "returncode": result.returncode,
            "wall_s": round(result.wall_s, 3),
            "stdout_tail": result.stdout_tail[-1000:],
            "stderr_tail": result.stderr_tail[-1000:],
            "sandbox": result.guarantees,
            "memory_peak_bytes": result.usage.memory_peak_bytes,
        }
        violation = result.limit_violation()
        if violation is not None:  # whatever the exit code: a worker killed for memory can end in a fail code
            raise EvaluatorError(f"{violation}: {result.stderr_tail[-300:]}")
        if result.timed_out:
            raise EvaluatorError(f"check timed out after {result.wall_s:.1f}s (process group killed)")
        code = result.returncode
        if code is None or code < 0:
            raise EvaluatorError(
                f"check killed by signal {-code if code else '?'}: {result.stderr_tail[-300:]}"
            )
        passed, failed = code in self.config.pass_codes, code in self.config.fail_codes
        if not passed and not failed:
            raise EvaluatorError(
                f"check exited {code}, neither a pass nor a fail code: {result.stderr_tail[-300:]}"
            )
        if self.config.score_from == "exit_code":
            return Verdict(score=1.0 if passed else 0.0, details=details)
        if result.score_file is None:
            raise EvaluatorError(f"check exited {code} without writing $GYRE_SCORE_FILE")
        return Verdict(score=parse_score(result.score_file), details=details)


def parse_score(text: str) -> float:
    """A score file holds a number, or a JSON object with a numeric ``score``."""
    text = text.strip()
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise EvaluatorError(f"score file is not a number: {text[:100]!r}") from None
    if isinstance(value, dict):
        value = value.get("score")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EvaluatorError(f"score file holds no finite score: {text[:100]!r}")
    return float(value)
