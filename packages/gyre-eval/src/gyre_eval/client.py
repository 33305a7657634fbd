"""Async client of the reward service (used by the execution runner, the controller and the trainer)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from gyre_eval.errors import EvalServiceError
from gyre_eval.types import (
    AdvantageMode,
    Assessment,
    AttemptRecord,
    ExecutionReport,
    GroupState,
    GroupStatus,
    Submission,
)

T = TypeVar("T")


class EvalClient:
    """``async with EvalClient("http://127.0.0.1:8700") as c: a = await c.submit(sub)``."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 30.0,
        client: httpx.AsyncClient | None = None,
        token: str | None = None,
        retry_s: float = 0.0,
    ) -> None:
        """`retry_s`: how long a call keeps retrying when the service cannot be reached (a restart in progress);
        every call is safe to repeat (submissions are idempotent)."""
        self.retry_s = retry_s
        # the service's token, if it has one
        headers = {"authorization": f"Bearer {token}"} if token else None
        self._http = client or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout, headers=headers
        )

    async def __aenter__(self) -> EvalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, adapter: TypeAdapter[T], **kw: Any) -> T:
        end = time.monotonic() + self.retry_s
        pause = 0.05
        while True:
            try:
                response = await self._http.request(method, path, **kw)
                break
            except httpx.TransportError:
                if time.monotonic() + pause > end:
                    raise
                await asyncio.sleep(pause)  # back-off while the service restarts
                pause = min(pause * 2, 1.0)
        if response.status_code >= 400:
            try:
                body = response.json()
                error, message = body.get("error", "error"), body.get("message", response.text)
            except ValueError:
                error, message = "error", response.text[:500]
            raise EvalServiceError(response.status_code, error, message)
        return adapter.validate_json(response.content)

    async def submit(self, submission: Submission) -> Assessment:
        """Idempotent: resubmitting the same execution, branch, artifact version and evaluator returns the same one."""
        return await self._call(
            "POST",
            "/v1/assessments",
            _A,
            content=submission.model_dump_json(),
            headers={"content-type": "application/json"},
        )

    async def get(self, assessment_id: str) -> Assessment:
        return await self._call("GET", f"/v1/assessments/{assessment_id}", _A)

    async def attempts(self, assessment_id: str) -> list[AttemptRecord]:
        return await self._call("GET", f"/v1/assessments/{assessment_id}/attempts", _ATTEMPTS)

    async def list(
        self,
        execution_id: str | None = None,
        group_id: str | None = None,
        status: str | None = None,
        designated: bool | None = None,
        limit: int = 1000,
    ) -> list[Assessment]:
        params = _params(
            execution_id=execution_id, group_id=group_id, status=status, designated=designated, limit=limit
        )
        return await self._call("GET", "/v1/assessments", _AS, params=params)

    async def execution(self, execution_id: str) -> ExecutionReport:
        return await self._call("GET", f"/v1/executions/{execution_id}", _EXEC)

    async def group(self, group_id: str, mode: AdvantageMode | None = None) -> GroupStatus:
        return await self._call("GET", f"/v1/groups/{group_id}", _G, params=_params(mode=mode))

    async def groups(
        self, state: GroupState | None = None, mode: AdvantageMode | None = None
    ) -> list[GroupStatus]:
        return await self._call("GET", "/v1/groups", _GS, params=_params(state=state, mode=mode))

    async def wait_final(self, assessment_id: str, timeout: float = 60.0, poll_s: float = 0.1) -> Assessment:
        """Poll until the assessment is final (valid, no_work, or unresolved with its budget spent)."""
        end = time.monotonic() + timeout
        while True:
            found = await self.get(assessment_id)
            if found.final:
                return found
            if time.monotonic() >= end:
                raise TimeoutError(f"assessment {assessment_id} not final after {timeout}s")
            await asyncio.sleep(poll_s)


def _params(**kw: Any) -> dict[str, Any]:
    return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in kw.items() if v is not None}


def _adapter(tp: type[BaseModel] | Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


_A = _adapter(Assessment)
_AS = _adapter(list[Assessment])
_ATTEMPTS = _adapter(list[AttemptRecord])
_EXEC = _adapter(ExecutionReport)
_G = _adapter(GroupStatus)
_GS = _adapter(list[GroupStatus])
