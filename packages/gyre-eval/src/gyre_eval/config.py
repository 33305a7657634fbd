"""Service configuration: the named evaluators and the retry and advantage settings. Loaded from JSON or TOML."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gyre_eval.evaluator import Evaluator, build_plugin
from gyre_eval.exec_check import ExecCheckConfig, ExecutableCheck
from gyre_eval.judge import Judge, JudgeConfig
from gyre_eval.types import AdvantageMode


class PluginConfig(BaseModel):
    """A user evaluator: ``factory`` ("package.module:callable") is called with ``options`` as keyword arguments."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["plugin"] = "plugin"
    factory: str = Field(min_length=3)
    options: dict[str, Any] = Field(default_factory=dict)


EvaluatorSpec = Annotated[ExecCheckConfig | JudgeConfig | PluginConfig, Field(discriminator="kind")]


class ServiceConfig(BaseModel):
    """The reward service: which evaluators exist, how failures are retried, how advantages are computed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    evaluators: dict[str, EvaluatorSpec] = Field(default_factory=dict)
    """Evaluators by name; a submission names one (default ``task``)."""
    max_concurrent: int = Field(default=4, ge=1)
    """Evaluations running at once; the rest wait (their budget keeps running)."""
    retry_wait_min_s: float = Field(default=1.0, ge=0)
    """First wait after a failed attempt (exponential backoff)."""
    retry_wait_max_s: float = Field(default=60.0, ge=0)
    """Longest wait between attempts; attempts never start after the execution's budget expires."""
    advantage_mode: AdvantageMode = "grpo"
    """Default advantage: GRPO (r - mean) / (std + 1e-6) with population std, or mean-only r - mean."""
    artifact_roots: list[str] | None = None
    """Directories a submission's ``artifact_ref`` must resolve under (after ``..`` and symlinks), else 422: the
    service copies what it assesses, so an unchecked path would let a caller have any folder the service can read
    (a root-only one) copied into a check. None: any path (only for a service no untrusted process can reach)."""

    def redacted(self) -> dict[str, Any]:
        """The resolved config as JSON data, secrets masked (what is written to the run directory)."""
        return json.loads(self.model_dump_json())  # SecretStr serializes as '**********'


def load_config(path: Path | str | None) -> ServiceConfig:
    if path is None:
        return ServiceConfig()
    path = Path(path)
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    return ServiceConfig.model_validate(data)


def build_evaluator(spec: ExecCheckConfig | JudgeConfig | PluginConfig) -> Evaluator:
    if isinstance(spec, ExecCheckConfig):
        return ExecutableCheck(spec)
    if isinstance(spec, JudgeConfig):
        return Judge(spec)
    return build_plugin(spec.factory, spec.options)
