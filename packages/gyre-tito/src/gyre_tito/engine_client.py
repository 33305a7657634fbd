"""Client for SGLang's token-in-token-out `POST /generate`, over a pool of engines with transparent retries.

- Requests carry `input_ids`, `return_logprob=true`, a `rid`, and stream by default (SSE, cumulative or incremental
  outputs both understood; a plain JSON answer is accepted too), so tokens produced before a failure are kept.
- A call that fails because its engine was drained, aborted (`finish_reason.type == "abort"`), unreachable or
  killed mid-stream is continued on another engine from `input + tokens produced so far`; the result merges the
  pieces and keeps one `Segment` (engine, weight version, span) per piece, so the caller sees one answer.
- Routing: least in-flight requests among the route's engines that are not draining and not cooling down after a
  failure. Routes are global (`set_engines`) or per execution (the caller passes `route`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from pydantic import BaseModel, Field

__all__ = ["EngineError", "EnginePool", "EnginePoolConfig", "EngineRejected", "GenerateResult", "Segment"]


class EnginePoolConfig(BaseModel):
    engines: list[str] = Field(
        default_factory=list, description="engine base URLs (SGLang-compatible /generate)"
    )
    stream: bool = Field(True, description="stream from the engine so partial output survives a failure")
    max_attempts: int = Field(8, description="engine attempts per call before giving up")
    retry_backoff_s: float = Field(0.2, description="wait before retrying when no engine is available")
    cooldown_s: float = Field(2.0, description="how long an engine that failed is skipped")
    request_timeout_s: float = Field(600.0, description="per-attempt timeout")


class EngineError(Exception):
    """No engine could finish the call within the configured attempts."""


class EngineRejected(Exception):
    """An engine refused the request itself (HTTP 400/422, e.g. input longer than its context): retrying elsewhere
    cannot help, and tokens already produced are discarded with the call."""


@dataclass
class Segment:
    engine: str
    weight_version: str
    start: int
    end: int


@dataclass
class GenerateResult:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    finish: str = "stop"  # stop | length | abort
    matched: Any = None  # the stop token id or stop string that ended the output
    attempts: int = 0
    first_token_at: float | None = None


@dataclass
class _EngineState:
    url: str
    inflight: dict[str, int] = field(default_factory=dict)  # rid -> tokens so far
    draining: bool = False
    cool_until: float = 0.0


@dataclass
class _Attempt:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: str | None = None
    matched: Any = None


def _apply(att: _Attempt, obj: dict[str, Any]) -> None:
    meta = obj.get("meta_info") or {}
    lps = meta.get("output_token_logprobs")
    ids = [int(t[1]) for t in lps] if lps is not None else list(obj.get("output_ids") or [])
    if lps is not None:
        lp = [float(t[0]) if t[0] is not None else math.nan for t in lps]
        if not all(math.isfinite(v) for v in lp):  # JSON null is how NaN travels: never record it as a number
            raise ValueError("engine returned a null or non-finite log-prob")
    else:
        lp = [0.0] * len(ids)
    ctoks = meta.get("completion_tokens")
    version = str(meta.get("weight_version", "default"))
    spans = meta.get("weight_versions")
    if ctoks is not None and ctoks == len(ids) and len(ids) >= len(att.ids):
        att.ids, att.logprobs = ids, lp  # cumulative chunk
        att.versions = att.versions[: len(ids)] + [version] * (len(ids) - len(att.versions))
    else:  # incremental chunk
        att.ids += ids
        att.logprobs += lp
        att.versions += [version] * len(ids)
    if isinstance(spans, list):  # SGLang >= 0.5.23: per-token version spans
        for s in spans:
            for i in range(int(s["start"]), min(int(s["end"]), len(att.versions))):
                att.versions[i] = str(s["version"])
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):
        att.finish = fr.get("type")
        att.matched = fr.get("matched")


def _error_message(raw: bytes) -> str:
    try:
        obj = orjson.loads(raw)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:500]
    except orjson.JSONDecodeError:
        return raw[:500].decode(errors="replace")


class EnginePool:
    """Least-loaded routing and retrying `/generate` calls over a set of engines."""

    def __init__(
        self, config: EnginePoolConfig, client: httpx.AsyncClient | None = None, api_key: str | None = None
    ):
        self.config = config
        self._engines: dict[str, _EngineState] = {}
        self.set_engines(config.engines)
        # Idle connections are dropped before uvicorn/SGLang's 5 s keep-alive ends, so a reused connection is never
        # closed by the engine under our feet (that would count as an engine failure and cool it down).
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None  # the engines' token, if any
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=5.0), limits=limits, headers=headers
        )
        self.retries = 0  # attempts beyond the first, over the pool's life (for /metrics)

    # ---- membership ------------------------------------------------------------------------------------------
    def set_engines(self, urls: list[str]) -> None:
        urls = [u.rstrip("/") for u in urls]
        for u in urls:
            self._engines.setdefault(u, _EngineState(u)).draining = False
        for u, st in list(self._engines.items()):
            if u not in urls:
                st.draining = True
                if not st.inflight:
                    del self._engines[u]

    def engines(self) -> list[dict[str, Any]]:
        return [
            {
                "url": s.url,
                "inflight": len(s.inflight),
                "draining": s.draining,
                "cooling": s.cool_until > time.time(),
            }
            for s in self._engines.values()
        ]

    async def drain(self, url: str, abort_inflight: bool = True, timeout_s: float = 30.0) -> int:
        """Stop routing to `url`; abort its in-flight calls (they continue elsewhere); wait until none is left."""
        url = url.rstrip("/")
        st = self._engines.get(url)
        if st is None:
            raise KeyError(url)
        st.draining = True
        n = len(st.inflight)
        if abort_inflight:
            for rid in list(st.inflight):
                with contextlib.suppress(httpx.HTTPError):
                    await self._client.post(
                        f"{url}/abort_request", json={"rid": rid, "abort_all": False}, timeout=5.0
                    )
        deadline = time.time() + timeout_s
        while st.inflight and time.time() < deadline:
            await asyncio.sleep(0.02)
        if not st.inflight:
            self._engines.pop(url, None)
        return n

    def _pick(self, route: list[str] | None) -> _EngineState | None:
        now = time.time()
        cands = [
            s
            for u, s in self._engines.items()
            if (route is None or u in route) and not s.draining and s.cool_until <= now
        ]
        if not cands and route is not None:  # route names engines the pool has not seen: adopt them
            for u in route:
                if u.rstrip("/") not in self._engines:
                    self._engines[u.rstrip("/")] = _EngineState(u.rstrip("/"))
            cands = [self._engines[u.rstrip("/")] for u in route if not self._engines[u.rstrip("/")].draining]
            cands = [s for s in cands if s.cool_until <= now]
        return min(cands, key=lambda s: len(s.inflight)) if cands else None

    # ---- generation ------------------------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling: dict[str, Any],
        route: list[str] | Callable[[], list[str] | None] | None = None,
        rid: str | None = None,
        on_accept: Callable[[], None] | None = None,
    ) -> GenerateResult:
        """Generate up to `sampling["max_new_tokens"]` tokens after `input_ids`, retrying across engines.

        `route` may be a callable: it is read again before every attempt, so a call interrupted because its engine
        left rollout continues on the execution's *new* route, never back on the engine being drained.
        `on_accept` is called once, when an engine first answers the request with a success status (it accepted it).
        """
        if not isinstance(input_ids, list):
            input_ids = list(input_ids)
        res = GenerateResult()
        budget = int(sampling.get("max_new_tokens", 128))
        base = rid or uuid.uuid4().hex
        for attempt in range(self.config.max_attempts):
            res.attempts = attempt + 1
            st = self._pick(route() if callable(route) else route)
            if st is None:
                await asyncio.sleep(self.config.retry_backoff_s * (attempt + 1))
                continue
            if attempt:
                self.retries += 1
            sp = dict(sampling, max_new_tokens=budget - len(res.output_ids))
            att_rid = f"{base}-{attempt}"
            att = _Attempt()
            st.inflight[att_rid] = 0
            failed = False
            try:
                await self._call(st.url, input_ids + res.output_ids, sp, att_rid, att, res, on_accept)
                on_accept = None
            except (httpx.HTTPError, ValueError, orjson.JSONDecodeError):
                failed = True
                st.cool_until = time.time() + self.config.cooldown_s
            finally:
                st.inflight.pop(att_rid, None)
                if st.draining and not st.inflight and st.url in self._engines:
                    self._engines.pop(st.url, None)
            if att.ids:
                start = len(res.output_ids)
                res.output_ids += att.ids
                res.logprobs += att.logprobs
                for i, v in enumerate(att.versions):  # one segment per (engine, version) run
                    last = res.segments[-1] if res.segments else None
                    if last and last.engine == st.url and last.weight_version == v and last.end == start + i:
                        last.end += 1
                    else:
                        res.segments.append(Segment(st.url, v, start + i, start + i + 1))
            if not failed and att.finish in ("stop", "length"):
                res.finish, res.matched = att.finish, att.matched
                return res
            if len(res.output_ids) >= budget:
                res.finish = "length"
                return res
            # aborted, killed or unreachable: continue from input + what was produced, on the current route
        raise EngineError(f"no engine finished the call after {self.config.max_attempts} attempts")

    async def _call(
        self, url: str, ids: list[int], sp: dict[str, Any], rid: str, att: _Attempt, res, on_accept=None
    ) -> None:
        body = {
            "rid": rid,
            "input_ids": ids,
            "sampling_params": sp,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": self.config.stream,
        }
        async with self._client.stream("POST", f"{url}/generate", content=orjson.dumps(body)) as r:
            if r.status_code in (400, 422):
                raise EngineRejected(_error_message(await r.aread()))
            if r.status_code >= 400:
                text = (await r.aread())[:300]
                raise httpx.HTTPStatusError(
                    f"engine answered {r.status_code}: {text!r}", request=r.request, response=r
                )
            if on_accept is not None:
                on_accept()
            if "text/event-stream" not in r.headers.get("content-type", ""):
                _apply(att, orjson.loads(await r.aread()))
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                _apply(att, orjson.loads(payload))
                if att.ids and res.first_token_at is None:
                    res.first_token_at = time.time()
            if att.finish is None:  # stream ended without a finish reason: the engine went away
                raise httpx.RemoteProtocolError("stream ended early")

    async def context_length(self, url: str, timeout_s: float = 10.0) -> int | None:
        """The engine's context length from `GET /server_info` (`context_length`; SGLang reports it when set),
        or None when the engine does not say or cannot be reached."""
        try:
            r = await self._client.get(f"{url.rstrip('/')}/server_info", timeout=timeout_s)
            value = r.json().get("context_length") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    async def aclose(self) -> None:
        await self._client.aclose()
