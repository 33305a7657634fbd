"""Request bodies of the proxy's admin API (`gyre_tito.admin`), one model per route that takes a body.

They are strict, as a hand check was before them: a JSON `true` is no count, `"5"` no number and `1` no boolean.
Keys a route does not know are ignored, except on `PUT /admin/routes`, where a misspelled `engines` must never read
as "no engines". A body that does not fit is answered 400 with each offending field named (`gyre_tito.admin`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = ["DrainRequest", "ExportRequest", "RegisterRequest", "RouteRequest", "RoutesRequest"]


def _http_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError("must be an http(s) URL")
    return url.rstrip("/")  # one spelling per engine: the pool and the routes compare them as strings


EngineUrl = Annotated[str, AfterValidator(_http_url)]
"""An engine's base URL: http(s), kept without its trailing slash."""


class _AdminRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, use_attribute_docstrings=True)


class RegisterRequest(_AdminRequest):
    """`POST /admin/executions`: register an execution; its credential is in the answer."""

    execution_id: str | None = Field(default=None, min_length=1)
    """The execution's id (the proxy draws one when absent); the proxy refuses ids unusable as file names."""
    group_id: str | None = Field(default=None, min_length=1)
    """Its group (the execution id when absent)."""
    route: list[EngineUrl] | None = None
    """The engines its calls may use (null: any engine of the pool)."""
    metadata: dict[str, Any] | None = None
    """Free-form, kept with the execution (null: none)."""


class RouteRequest(_AdminRequest):
    """`PUT /admin/executions/{id}/route`: the engines one execution's calls may use."""

    engines: list[EngineUrl] | None = None
    """Null or absent: any engine of the pool."""


class ExportRequest(_AdminRequest):
    """`POST /admin/executions/{id}/export`: select (J_max admission) and materialise an execution's trajectories."""

    j_max: int = Field(default=5, ge=1, le=10_000)
    """At most this many trajectories."""
    seed: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    """Seed of the selection's tie-breaking."""
    include_other: bool = False
    """Also admit calls of role `other` (after the known roles)."""
    path: str | None = None
    """Also write them here (.jsonl or .parquet), under STORE/exports or an `--export-dir`."""
    no_work: bool = False
    """The execution left no assessable work: export its placeholder trajectory."""


class RoutesRequest(_AdminRequest):
    """`PUT /admin/routes`: the pool's engines. Unknown keys are refused: a typo must not empty the pool."""

    model_config = ConfigDict(extra="forbid")

    engines: list[EngineUrl]
    """The new engine list (required, never null)."""


class DrainRequest(_AdminRequest):
    """`POST /admin/engines/drain`: stop routing to an engine and wait for (or abort) its calls."""

    engine: str
    """The engine's URL as the pool lists it."""
    abort_inflight: bool = True
    """Abort its running calls (they are retried elsewhere) rather than wait for them."""
    timeout_s: float = Field(default=30.0, ge=0, le=3600, allow_inf_nan=False)
    """How long to wait for its calls, in seconds."""
