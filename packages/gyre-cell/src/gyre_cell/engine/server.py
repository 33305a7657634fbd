"""HTTP server of the torch engine: SGLang's native endpoints with SGLang's response shapes.

Errors follow SGLang: `{"error": {"message": ...}}` with status 400 for generation/control errors, and
`{"success": false, "message": ...}` with 400 for weight updates. The server survives every bad request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from gyre_cell.errors import BadRequest, EngineInputError, EngineStateError

from ..protocol import (
    AbortBody,
    ContinueBody,
    GenerateBody,
    MemoryTagsBody,
    PauseBody,
)
from .core import TorchEngine
from .request import SamplingSpec
from .server_kv import add_kv_routes
from .server_weights import add_weight_routes

HEALTH_TIMEOUT_S = 20.0


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def parse_body[B: BaseModel](request: Request, model: type[B]) -> B:
    raw = await request.body()
    try:
        data = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        details = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise BadRequest(f"invalid {model.__name__}: {details}") from e


def _sampling_spec(body: GenerateBody) -> SamplingSpec:
    sp = body.sampling_params
    if sp.n != 1:
        raise BadRequest("sampling_params.n > 1 is not supported by the torch engine")
    if sp.json_schema is not None or sp.regex is not None:
        raise BadRequest("constrained decoding (json_schema, regex) is not supported by the torch engine")
    if body.top_logprobs_num:
        raise BadRequest("top_logprobs_num > 0 is not supported by the torch engine")
    if body.return_logprob and body.logprob_start_len >= 0:
        raise BadRequest("prompt log-probs (logprob_start_len >= 0) are not supported by the torch engine")
    if sp.min_p > 0:
        raise BadRequest("min_p is not supported by the torch engine")
    stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    return SamplingSpec(
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        stop=stop,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        no_stop_trim=sp.no_stop_trim,
        sampling_seed=sp.sampling_seed,
    )


def _input_ids(engine: TorchEngine, body: GenerateBody) -> list[int]:
    if body.input_ids is not None:
        if body.input_ids and isinstance(body.input_ids[0], list):
            raise BadRequest("batched input_ids are not supported: send one request per sequence")
        return list(body.input_ids)  # type: ignore[arg-type]
    if isinstance(body.text, str):
        if engine.tokenizer is None:
            raise BadRequest("text input needs a tokenizer; this model has none (send input_ids)")
        return engine.tokenizer.encode(body.text, add_special_tokens=False)
    raise BadRequest("give input_ids (a list of ints) or text (a string)")


UNAUTHENTICATED = frozenset({("GET", "/health")})
"""What answers without the engine's token (liveness only; it says nothing about the engine)."""


def require_token(app: FastAPI, api_key: str | None) -> None:
    """Every request but `GET /health` needs `Authorization: Bearer <api_key>` (SGLang's `--api-key` shape); 401
    otherwise. No key: the app is open, for loopback-only deployments (see the README's trust model)."""
    if api_key:
        app.add_middleware(_TokenGate, expected=api_key.encode())


class _TokenGate:
    """The token check as a plain ASGI middleware. Starlette's `@app.middleware("http")` (BaseHTTPMiddleware)
    passes every body chunk of a response through its own memory stream and task; on the engine's token streams
    that was about 9% of a cell worker's busy samples in `gyre demo` (py-spy). This one only reads the headers."""

    def __init__(self, app: Any, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) not in UNAUTHENTICATED:
            auth = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.expected):
                response = error_response("missing or wrong engine token (Authorization: Bearer ...)", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _LoopMailbox:
    """Hands the engine thread's outputs to the event loop with one wake-up per batch of them, not one per token.

    Each `call_soon_threadsafe` writes to the loop's self-pipe; at one call per streamed token, that write (and the
    GIL hand-over to the loop thread around it) took about a third of the engine thread's time in `gyre demo`
    (py-spy). Outputs posted while a wake-up is pending ride on it; every request's queue still gets each of its
    outputs, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._pending = False

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """From any thread: ``queue.put_nowait(item)`` on the loop."""
        with self._lock:
            self._items.append((queue, item))
            if self._pending:
                return
            self._pending = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._pending = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


def create_app(engine: TorchEngine, *, api_key: str | None = None) -> FastAPI:
    """The engine's HTTP app; with `api_key`, every endpoint but `GET /health` needs it as a bearer token."""
    app = FastAPI(title="gyre-cell torch engine")
    app.state.engine = engine
    require_token(app, api_key)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc))

    @app.exception_handler(EngineInputError)
    async def _bad_input(_: Request, exc: EngineInputError) -> JSONResponse:
        return error_response(str(exc))

    @app.exception_handler(EngineStateError)
    async def _bad_state(_: Request, exc: EngineStateError) -> JSONResponse:
        return error_response(str(exc))

    mailbox: list[_LoopMailbox | None] = [None]

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateBody)
        rid = body.rid or uuid.uuid4().hex
        spec = _sampling_spec(body)
        ids = _input_ids(engine, body)
        loop = asyncio.get_running_loop()
        if mailbox[0] is None or mailbox[0].loop is not loop:  # one per serving loop
            mailbox[0] = _LoopMailbox(loop)
        post = mailbox[0].post
        queue: asyncio.Queue[tuple[dict[str, Any], bool]] = asyncio.Queue()

        def sink(out: dict[str, Any], finished: bool) -> None:
            post(queue, (out, finished))

        engine.submit(
            rid=rid,
            input_ids=ids,
            sampling=spec,
            return_logprob=body.return_logprob,
            stream=body.stream,
            sink=sink,
        )
        if not body.stream:
            try:
                while True:
                    out, finished = await queue.get()
                    if finished:
                        return Response(orjson.dumps(out), media_type="application/json")
            except asyncio.CancelledError:  # client went away: do not leave the request running
                _abort_quietly(engine, rid)
                raise

        async def frames():
            finished = False
            try:
                while not finished:
                    out, finished = await queue.get()
                    # Outputs are cumulative (SGLang's default): of those already queued only the newest is sent,
                    # as SGLang's own stream does when the client reads slower than the engine decodes.
                    while not finished and not queue.empty():
                        out, finished = queue.get_nowait()
                    yield b"data: " + orjson.dumps(out) + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                if not finished:
                    _abort_quietly(engine, rid)

        return StreamingResponse(frames(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await parse_body(request, AbortBody)
        if not body.abort_all and not body.rid:
            raise BadRequest("give rid or abort_all=true")
        await asyncio.to_thread(engine.abort, body.rid, abort_all=body.abort_all)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await parse_body(request, PauseBody)
        await asyncio.to_thread(engine.pause, body.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await parse_body(request, ContinueBody)
        await asyncio.to_thread(engine.resume_generation)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(request: Request) -> Response:
        body = await parse_body(request, MemoryTagsBody)
        await asyncio.to_thread(engine.release_memory, body.tags)
        return Response(b"null", media_type="application/json")

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: Request) -> Response:
        body = await parse_body(request, MemoryTagsBody)
        await asyncio.to_thread(engine.resume_memory, body.tags)
        return Response(b"null", media_type="application/json")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        try:
            await asyncio.to_thread(engine.flush_cache)
        except EngineStateError as e:
            return Response(f"{e}\n", status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine.released or engine.paused:
            return Response(status_code=503)
        if not engine.is_idle():
            return Response(status_code=200)  # like SGLang: a busy engine is evidently generating
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()

        def sink(_: dict[str, Any], finished: bool) -> None:
            if finished:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(True))

        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        spec = SamplingSpec(max_new_tokens=1, temperature=0.0)
        engine.submit(rid=rid, input_ids=[0], sampling=spec, return_logprob=False, stream=False, sink=sink)
        try:
            await asyncio.wait_for(done, HEALTH_TIMEOUT_S)
        except TimeoutError:
            _abort_quietly(engine, rid)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        cfg = engine.model.config
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.config.served_model_name or engine.config.model_path,
            "tokenizer_path": engine.config.model_path if engine.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "load_format": "safetensors",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": getattr(cfg, "architectures", None),
        }

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            **engine.config.model_dump(),
            "device": str(engine.device),
            "paused": engine.paused,
            "released_tags": sorted(engine.released),
            "weight_update_session_open": engine.update_session_open,
            "context_length": engine.context_len,
            "version": "gyre-cell",
        }

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": "gyre-cell",
            "accelerator": str(engine.device),
            "num_accelerators": 1,
            "loads": [await asyncio.to_thread(engine.load)],
        }

    add_weight_routes(app, engine, parse_body)
    add_kv_routes(app, engine, parse_body, api_key=api_key)
    return app


def _abort_quietly(engine: TorchEngine, rid: str) -> None:
    with contextlib.suppress(EngineInputError):  # already finished
        engine.abort(rid)
