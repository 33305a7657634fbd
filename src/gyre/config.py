"""The resolved configuration of a Gyre run: one typed tree, loaded from TOML/JSON, written first to RUN/config.json.

Nothing is derived silently: values that depend on others (for example the scheduler's queue depth) are computed by
the components from these fields and logged in the trace header, never written back into the config.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["ConfigError", "RunConfig", "load_config"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Section):
    path: str | None = None
    """A local Hugging Face checkpoint; None builds the tiny offline Qwen3 model into RUN/model."""
    temperature: float = Field(1.0, gt=0)
    """Rollout sampling temperature; the trainer computes log-probs at the same temperature."""


class ClusterConfig(_Section):
    cells: int = Field(2, ge=1)
    """K: elastic cells; cell 0 is the core (optimizer owner). On CPU each cell is one engine process."""
    executions_per_cell: int = Field(4, ge=1)
    """C_e: concurrent executions one cell serves in rollout."""
    policy: Literal["elastic", "async", "colocate"] = "elastic"
    """Scheduling policy (DESIGN §5.2)."""


class AlgorithmConfig(_Section):
    group_size: int = Field(4, ge=2)
    """N: executions per rollout group."""
    batch_groups: int = Field(2, ge=1)
    """B: groups per optimizer step."""
    phi: float = Field(0.5, ge=0)
    """Extra dispatch in units of B groups (phi * B must be whole)."""
    mu: int = Field(1, ge=1)
    """Optimizer steps per burst (between weight publications)."""
    steps: int = Field(3, ge=1)
    """Optimizer steps to run."""
    j_max: int = Field(5, ge=1)
    """Trajectories admitted per execution (DESIGN §4.3)."""
    lr: float = Field(3e-3, gt=0)
    """Adam learning rate (the tiny demo model learns visibly at this rate; the paper uses 1e-6)."""
    seed: int = 0
    """Seeds selection, sampling order and the tiny model."""

    @model_validator(mode="after")
    def _phi_b_whole(self) -> AlgorithmConfig:
        if abs(self.phi * self.batch_groups - round(self.phi * self.batch_groups)) > 1e-9:
            raise ValueError(
                f"phi * B must be a whole number of groups (phi={self.phi}, B={self.batch_groups})"
            )
        return self


class AgentConfig(_Section):
    max_turns: int = Field(3, ge=1)
    """Model calls per execution before the built-in agent submits."""
    max_tokens: int = Field(32, ge=1)
    """max_tokens per model call."""
    harness_timeout_s: float = Field(120.0, gt=0)
    """The task's own deadline: the execution stops and its work is still assessed."""
    overall_budget_s: float = Field(300.0, gt=0)
    """From launch, execution plus evaluation retries; exhausted without a score = excluded."""


class RunConfig(_Section):
    run_dir: str | None = None
    """None: runs/<UTC timestamp>. Where config.json, trace.jsonl, records/, assessments.sqlite, trajectories/, checkpoints/, report.html go."""
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    agent: AgentConfig = AgentConfig()


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the field."""


def load_config(path: Path | None, overrides: dict | None = None) -> RunConfig:
    data: dict = {}
    if path is not None:
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        where = f"{path}: " if path else ""
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{where}{problems}") from exc
