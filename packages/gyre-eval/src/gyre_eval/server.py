"""HTTP API of the reward service (FastAPI). Every 4xx answer is an ``ErrorBody`` JSON object."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gyre_eval.config import ServiceConfig, build_evaluator
from gyre_eval.errors import ArtifactOutsideRootsError, ConflictError, NotFoundError, UnknownEvaluatorError
from gyre_eval.evaluator import Evaluator
from gyre_eval.service import AssessmentService
from gyre_eval.store import AssessmentStore
from gyre_eval.types import (
    AdvantageMode,
    Assessment,
    AssessmentStatus,
    AttemptRecord,
    ErrorBody,
    ExecutionReport,
    GroupState,
    GroupStatus,
    Submission,
)


def _error(status: int, error: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=ErrorBody(error=error, message=message).model_dump())


def _validation_message(errors: list) -> str:
    parts = []
    for err in errors[:10]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def create_app(
    run_dir: Path | str,
    config: ServiceConfig,
    evaluators: dict[str, Evaluator] | None = None,
    *,
    token: str | None = None,
) -> FastAPI:
    """The service app; the store opens and unfinished assessments resume when the app starts.

    Evaluators are built here, so a bad plug-in reference fails before the server listens. With ``token`` every
    endpoint but ``GET /healthz`` needs ``Authorization: Bearer <token>`` (401 otherwise): without it any local process
    could submit (or block) another execution's reward first."""
    if evaluators is None:
        evaluators = {name: build_evaluator(spec) for name, spec in config.evaluators.items()}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = AssessmentStore(run_dir)
        service = AssessmentService(store, config, evaluators)
        await service.start()
        app.state.service = service
        try:
            yield
        finally:
            await service.close()
            store.close()

    app = FastAPI(title="gyre-eval", version="1", lifespan=lifespan)

    def svc(request: Request) -> AssessmentService:
        return request.app.state.service

    if token:
        expected = token.encode()

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if (request.method, request.url.path) != ("GET", "/healthz"):
                auth = request.headers.get("authorization", "")
                given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
                if not hmac.compare_digest(given, expected):
                    return _error(
                        401, "unauthorized", "missing or wrong service token (Authorization: Bearer ...)"
                    )
            return await call_next(request)

    @app.exception_handler(ArtifactOutsideRootsError)
    async def _outside(_: Request, exc: ArtifactOutsideRootsError) -> JSONResponse:
        return _error(422, "artifact_outside_roots", str(exc))

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        return _error(422, "invalid_request", "request nested too deeply")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "invalid_request", _validation_message(list(exc.errors())))

    @app.exception_handler(ValidationError)
    async def _invalid_model(_: Request, exc: ValidationError) -> JSONResponse:
        return _error(422, "invalid_request", _validation_message(list(exc.errors())))

    @app.exception_handler(ConflictError)
    async def _conflict(_: Request, exc: ConflictError) -> JSONResponse:
        return _error(409, "conflict", str(exc))

    @app.exception_handler(UnknownEvaluatorError)
    async def _unknown_evaluator(_: Request, exc: UnknownEvaluatorError) -> JSONResponse:
        return _error(422, "unknown_evaluator", str(exc))

    @app.exception_handler(NotFoundError)
    async def _not_found(_: Request, exc: NotFoundError) -> JSONResponse:
        return _error(404, "not_found", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", str(exc.detail))

    @app.get("/healthz")
    async def healthz(request: Request) -> dict:
        return {"ok": True, "unfinished": len(svc(request).store.unfinished())}

    @app.post("/v1/assessments", response_model=Assessment)
    async def submit(request: Request, submission: Submission) -> JSONResponse:
        assessment, created = svc(request).submit(submission)
        return JSONResponse(status_code=201 if created else 200, content=assessment.model_dump(mode="json"))

    @app.get("/v1/assessments", response_model=list[Assessment])
    async def list_assessments(
        request: Request,
        execution_id: str | None = None,
        group_id: str | None = None,
        status: AssessmentStatus | None = None,
        designated: bool | None = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> list[Assessment]:
        return svc(request).store.list(execution_id, group_id, status, designated, limit)

    @app.get("/v1/assessments/{aid}", response_model=Assessment)
    async def get_assessment(request: Request, aid: str) -> Assessment:
        found = svc(request).store.get(aid)
        if found is None:
            raise NotFoundError(f"no assessment {aid}")
        return found

    @app.get("/v1/assessments/{aid}/attempts", response_model=list[AttemptRecord])
    async def get_attempts(request: Request, aid: str) -> list[AttemptRecord]:
        if svc(request).store.get(aid) is None:
            raise NotFoundError(f"no assessment {aid}")
        return svc(request).store.attempts(aid)

    @app.get("/v1/executions/{execution_id}", response_model=ExecutionReport)
    async def get_execution(request: Request, execution_id: str) -> ExecutionReport:
        history = svc(request).store.list(execution_id=execution_id, limit=1_000_000)
        if not history:
            raise NotFoundError(f"no assessment of execution {execution_id}")
        designated = next((a for a in history if a.designated), None)
        reward = designated.score if designated is not None and designated.status != "unresolved" else None
        return ExecutionReport(
            execution_id=execution_id,
            status=designated.status if designated else None,
            reward=reward,
            excluded=bool(designated and designated.excluded),
            designated=designated,
            history=history,
        )

    @app.get("/v1/groups", response_model=list[GroupStatus])
    async def list_groups(
        request: Request, state: GroupState | None = None, mode: AdvantageMode | None = None
    ) -> list[GroupStatus]:
        return svc(request).groups(state, mode)

    @app.get("/v1/groups/{group_id}", response_model=GroupStatus)
    async def get_group(request: Request, group_id: str, mode: AdvantageMode | None = None) -> GroupStatus:
        found = svc(request).group(group_id, mode)
        if found is None:
            raise NotFoundError(f"no group {group_id}")
        return found

    return app
