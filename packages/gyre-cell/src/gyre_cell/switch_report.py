"""The report of one role switch (`gyre_cell.roles`): a wire type the controller puts in its trace and metrics.

Apart from `roles` (which imports torch) so that the controller, which only receives it, starts without torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gyre_sched.types import CellRole

__all__ = ["PhaseTiming", "SwitchReport"]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = 1


class PhaseTiming(_Wire):
    """Wall time of one phase of a switch."""

    name: str
    seconds: float = Field(ge=0)


class SwitchReport(_Wire):
    """One completed switch of one cell (the TO_* role is passed through on the way)."""

    cell: str
    from_role: CellRole
    to_role: CellRole
    phases: list[PhaseTiming]
    total_s: float = Field(ge=0)
    weight_version: str | None = None
    """Version the engine serves after a switch to rollout (None for a switch to training)."""
