"""`StopGate`, the one wire type of the cell worker (``gyre_cell.worker_types``) that a run config embeds, in a
module without torch: ``gyre.config`` imports it, and reading a config must not load torch (``worker_types`` does,
through the engine and role types). ``gyre_cell.worker_types`` re-exports it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["StopGate"]


class _Wire(BaseModel):  # the same base as worker_types' own
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = 1


class StopGate(_Wire):
    """Test gate: cell `cell` stops itself (SIGSTOP) the first time it reaches `at`, as a host that stops answering
    there does: right before its end-of-batch reduce (`reduce`), or when asked to re-form the gloo world (`reform`).
    A restarted worker does not arm it."""

    cell: int = Field(ge=1)
    at: Literal["reduce", "reform"]
