"""The FastAPI app: Anthropic Messages, OpenAI Chat Completions, models, health, metrics and the admin API.

Every harness endpoint authenticates the execution credential (`x-api-key` or `Authorization: Bearer`); errors are
returned in the calling protocol's own shape (Anthropic `{"type": "error", "error": {...}}`, OpenAI
`{"error": {...}}`) with a 4xx status (529 when no engine can serve), never a 500. A streamed response starts as soon
as the request is validated (`message_start`, then keep-alive pings); its content is sent only after the call is
recorded durably, so every token a harness sees is on disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from gyre_tito import anthropic_api, openai_api
from gyre_tito.admin import admin_router, has_admin_token
from gyre_tito.errors import ProtocolError
from gyre_tito.proxy import Proxy
from gyre_tito.request_bytes import RequestHistory, load_request

__all__ = ["create_app"]

log = logging.getLogger("gyre_tito.server")


def _credential(req: Request) -> str | None:
    key = req.headers.get("x-api-key")
    if key:
        return key
    auth = req.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


async def _json(req: Request, limit: int, history: RequestHistory | None = None) -> Any:
    """The JSON body, read in chunks and refused with 413 as soon as it exceeds `limit` bytes (before parsing).
    With an execution's `history`, only the bytes its recent bodies did not have are parsed (`request_bytes`)."""
    declared = req.headers.get("content-length")
    too_big = ProtocolError(413, "request_too_large", f"request body exceeds {limit} bytes")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in req.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise ProtocolError(
            400, "invalid_request_error", "client disconnected before sending the body"
        ) from None
    raw = b"".join(chunks)
    try:
        return load_request(raw, history)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(400, "invalid_request_error", f"request body is not valid JSON: {e}") from e


def _anthropic_error(e: ProtocolError) -> JSONResponse:
    return JSONResponse(anthropic_api.error_body(e.kind, e.message), status_code=e.status)


def _openai_error(e: ProtocolError) -> JSONResponse:
    return JSONResponse(openai_api.error_body(e.kind, e.message, e.status), status_code=e.status)


def _headers_meta(req: Request, body: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"model": body.get("model")}
    sid = req.headers.get("x-claude-code-session-id")
    if sid:
        meta["session_id"] = sid
    ua = req.headers.get("user-agent")
    if ua:
        meta["user_agent"] = ua[:200]
    return meta


def create_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="gyre-tito", docs_url=None, redoc_url=None)
    app.state.proxy = proxy
    counters: dict[tuple[str, int], int] = {}

    def count(api: str, status: int) -> None:
        counters[(api, status)] = counters.get((api, status), 0) + 1

    @app.exception_handler(Exception)
    # last resort: still the protocol's shape
    async def _unexpected(req: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", req.url.path)
        e = ProtocolError(500, "api_error", f"internal error: {type(exc).__name__}")
        return _openai_error(e) if req.url.path.startswith("/v1/chat") else _anthropic_error(e)

    async def _streamed(call, first: bytes, ping: bytes, content, on_error, api: str) -> StreamingResponse:
        """Stream `first` once an engine accepted the call, keep-alives while it works, then the content (or an
        error event).

        The response starts only when an engine accepted the request (or after `keepalive_s`, whichever is first):
        a request the engine refuses (400) or that no engine can take in that time is answered with its own HTTP
        status, not a 200 carrying an error. The generation runs as its own task: a harness that disconnects does not
        cancel it, so the call is still recorded (and its tool-call payloads cached) when the harness retries."""
        task = asyncio.ensure_future(proxy.finish(call))
        # never "exception was never retrieved"
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        accepted = asyncio.ensure_future(call.accepted.wait())
        try:
            await asyncio.wait(
                {task, accepted}, timeout=proxy.config.keepalive_s, return_when="FIRST_COMPLETED"
            )
        finally:
            accepted.cancel()
        if task.done() and isinstance(task.exception(), ProtocolError):
            raise task.exception()

        async def frames():
            yield first
            while not task.done():
                await asyncio.wait({task}, timeout=proxy.config.keepalive_s)
                if not task.done():
                    yield ping
            try:
                reply, _ = task.result()
            except ProtocolError as e:
                count(api, e.status)
                yield on_error(e)
                return
            except Exception as e:  # a bug: still end the stream in the protocol's shape
                log.exception("call failed after the stream started")
                yield on_error(ProtocolError(500, "api_error", f"internal error: {type(e).__name__}"))
                return
            count(api, 200)
            for f in content(reply):
                yield f

        return StreamingResponse(frames(), media_type="text/event-stream")

    @app.post("/v1/messages")
    async def messages(req: Request) -> Response:
        try:
            ex = proxy.authenticate(_credential(req))
            body = await _json(req, proxy.request_bytes_limit, ex.request_history)
            conv, sampling, stream = anthropic_api.parse_request(
                body, proxy.config.volatile_patterns, ex.turn_cache
            )
            call = await proxy.prepare(
                ex, conv, sampling, "anthropic", _headers_meta(req, body), body, dict(req.headers)
            )
            if stream:  # headers and message_start go out now; content only once the call is recorded
                model = call.meta.get("model") or proxy.config.model_name
                first = anthropic_api.sse_message_start(call.msg_id, model, call.input_tokens)
                return await _streamed(
                    call,
                    first,
                    anthropic_api.sse_ping(),
                    anthropic_api.sse_content,
                    lambda e: anthropic_api.sse_error(e.kind, e.message),
                    "anthropic",
                )
            reply, _ = await proxy.finish(call)
        except ProtocolError as e:
            count("anthropic", e.status)
            return _anthropic_error(e)
        count("anthropic", 200)
        return JSONResponse(anthropic_api.response_body(reply))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: Request) -> Response:
        try:
            ex = proxy.authenticate(_credential(req))
            body = await _json(req, proxy.request_bytes_limit)
            if isinstance(body, dict):
                body = {"max_tokens": 1, **body}
            conv, _, _ = anthropic_api.parse_request(body, proxy.config.volatile_patterns)
            return JSONResponse({"input_tokens": await proxy.count_tokens(ex, conv)})
        except ProtocolError as e:
            return _anthropic_error(e)

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> Response:
        try:
            ex = proxy.authenticate(_credential(req))
            body = await _json(req, proxy.request_bytes_limit, ex.request_history)
            conv, sampling, stream, opts = openai_api.parse_request(
                body, proxy.config.volatile_patterns, ex.turn_cache
            )
            call = await proxy.prepare(
                ex, conv, sampling, "openai", _headers_meta(req, body), body, dict(req.headers)
            )
            if stream:
                model = call.meta.get("model") or proxy.config.model_name
                return await _streamed(
                    call,
                    openai_api.stream_role_chunk(call.msg_id, model),
                    openai_api.KEEPALIVE,
                    lambda r: openai_api.stream_chunks(r, opts, include_role=False),
                    lambda e: openai_api.stream_error(e.kind, e.message, e.status),
                    "openai",
                )
            reply, _ = await proxy.finish(call)
        except ProtocolError as e:
            count("openai", e.status)
            return _openai_error(e)
        count("openai", 200)
        return JSONResponse(openai_api.response_body(reply, opts))

    @app.get("/v1/models")
    async def models(req: Request) -> Response:
        name = proxy.config.model_name
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "type": "model",
                        "display_name": name,
                        "created": 0,
                        "owned_by": "gyre",
                    }
                ],
            }
        )

    @app.get("/health")
    async def health(req: Request) -> dict[str, Any]:
        # Liveness for anyone (launchers and probes hold no token): it says only what an open port says. The
        # engines, counts and quarantine are the operator's, as is /metrics: agents reach this port too.
        if not has_admin_token(proxy, req):
            return {"status": "ok"}
        return {
            "status": "ok",
            "engines": proxy.pool.engines(),
            "executions": len(proxy.executions) + len(proxy.ended),
            "quarantined": len(proxy.quarantined),
        }

    @app.get("/metrics")
    async def metrics(req: Request) -> Response:
        if not has_admin_token(proxy, req):
            return _anthropic_error(
                ProtocolError(401, "authentication_error", "/metrics needs the admin token")
            )
        s = proxy.stats
        lines = [
            "# TYPE gyre_tito_calls_total counter",
            f"gyre_tito_calls_total {int(s['calls'])}",
            "# TYPE gyre_tito_input_tokens_total counter",
            f"gyre_tito_input_tokens_total {int(s['input_tokens'])}",
            "# TYPE gyre_tito_output_tokens_total counter",
            f"gyre_tito_output_tokens_total {int(s['output_tokens'])}",
            "# TYPE gyre_tito_record_fsyncs_total counter",
            f"gyre_tito_record_fsyncs_total {proxy.records.fsyncs}",
            "# TYPE gyre_tito_overhead_seconds_total counter",
            f"gyre_tito_overhead_seconds_total {s['overhead_s']:.6f}",
            "# TYPE gyre_tito_engine_retries_total counter",
            f"gyre_tito_engine_retries_total {proxy.pool.retries}",
            "# TYPE gyre_tito_kv_reroutes_total counter",
            f"gyre_tito_kv_reroutes_total {proxy.pool.kv_stats['reroutes']}",
            "# TYPE gyre_tito_kv_migrated_reroutes_total counter",
            f"gyre_tito_kv_migrated_reroutes_total {proxy.pool.kv_stats['migrated']}",
            "# TYPE gyre_tito_kv_migrated_tokens_total counter",
            f"gyre_tito_kv_migrated_tokens_total {proxy.pool.kv_stats['migrated_tokens']}",
            "# TYPE gyre_tito_kv_served_tokens_total counter",
            f"gyre_tito_kv_served_tokens_total {proxy.pool.kv_stats['served_tokens']}",
            "# TYPE gyre_tito_kv_recomputed_tokens_total counter",
            f"gyre_tito_kv_recomputed_tokens_total {proxy.pool.kv_stats['recomputed_tokens']}",
            "# TYPE gyre_tito_kv_migrated_bytes_total counter",
            f"gyre_tito_kv_migrated_bytes_total {proxy.pool.kv_stats['bytes']}",
            "# TYPE gyre_tito_kv_reroute_first_token_seconds summary",
            f"gyre_tito_kv_reroute_first_token_seconds_sum {proxy.pool.kv_stats['first_token_s']:.6f}",
            f"gyre_tito_kv_reroute_first_token_seconds_count {proxy.pool.kv_stats['first_tokens']}",
            "# TYPE gyre_tito_executions gauge",
            f'gyre_tito_executions{{state="active"}} {sum(not e.ended for e in proxy.executions.values())}',
            f'gyre_tito_executions{{state="ended"}} '
            f"{len(proxy.ended) + sum(e.ended for e in proxy.executions.values())}",
            "# TYPE gyre_tito_engine_inflight gauge",
        ]
        lines += [
            f'gyre_tito_engine_inflight{{engine="{e["url"]}"}} {e["inflight"]}' for e in proxy.pool.engines()
        ]
        lines.append("# TYPE gyre_tito_requests_total counter")
        lines += [
            f'gyre_tito_requests_total{{api="{a}",status="{st}"}} {n}'
            for (a, st), n in sorted(counters.items())
        ]
        lines.append(f"# generated {time.time():.3f}")
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    app.include_router(admin_router())
    return app
