"""Client for SGLang's token-in-token-out `POST /generate`, over a pool of engines with transparent retries.

- Requests carry `input_ids`, `return_logprob=true`, a `rid`, and stream by default (SSE, cumulative or incremental
  outputs both understood; a plain JSON answer is accepted too), so tokens produced before a failure are kept.
- A call that fails because its engine was drained, aborted (`finish_reason.type == "abort"`), unreachable or
  killed mid-stream is continued on another engine from `input + tokens produced so far`; the result merges the
  pieces and keeps one `Segment` (engine, weight version, span) per piece, so the caller sees one answer.
- KV-cache migration on reroute (docs/design/cells.md): `drain` asks each in-flight request's engine to pin its KV blocks
  (`POST /kv/pin`, which also ends the request) instead of a plain abort; the retry first asks the destination to
  take the blocks over (`POST /kv/takeover`: it reads them over Mooncake, checks layout and identity, installs them
  and acknowledges to the source) and then sends the request there as usual, so the destination skips the prefill.
  An engine without `/kv/pin` (SGLang), a refusal or any failure falls back to a plain abort and a recompute.
  Calls made with a `key` (the proxy passes the execution id) also leave their context behind: `drain` moves the
  reusable prefix of every execution last served by the drained engine to an engine of its current route right away
  (pin by token ids, takeover), so the execution's next call starts from migrated blocks too: that call waits for
  its context's move if one runs, and goes to the engine holding the blocks whenever its route still includes it.
  An execution whose route no longer includes the engine holding its context (the controller reroutes before it
  drains) takes the context along on its next call: pin there, takeover at the new engine, then the call. What a
  moved call was served from is what the engine reports as `migrated_tokens` (torch engines), else `cached_tokens`.
- Routing: least in-flight requests among the route's engines that are not draining and not cooling down after a
  failure. Routes are global (`set_engines`) or per execution (the caller passes `route`).
"""

from __future__ import annotations

import asyncio
import functools
import math
import sys
import time
import uuid
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson
from pydantic import BaseModel, Field, model_validator

from gyre_tito import vllm_wire
from gyre_tito.errors import EngineRejected, EnginesExhausted
from gyre_tito.kv_moves import KVMoves, Reroute

__all__ = [
    "EngineAPI",
    "EnginePool",
    "EnginePoolConfig",
    "EngineRejected",
    "EnginesExhausted",
    "GenerateResult",
    "Reroute",
    "Segment",
]


EngineAPI = Literal["sglang", "vllm"]


class EnginePoolConfig(BaseModel):
    engines: list[str] = Field(
        default_factory=list, description="engine base URLs (SGLang-compatible /generate)"
    )
    api: EngineAPI = Field(
        "sglang",
        description="the engines' token-in/token-out route: SGLang's `/generate` (SGLang, Gyre's torch engine) or "
        "vLLM's `/inference/v1/generate` (a vLLM server started with `--enable-scale-out`)",
    )
    stream: bool = Field(True, description="stream from the engine so partial output survives a failure")
    max_attempts: int = Field(8, description="engine attempts per call before giving up")
    retry_backoff_s: float = Field(0.2, description="wait before retrying when no engine is available")
    cooldown_s: float = Field(2.0, description="how long an engine that failed is skipped")
    request_timeout_s: float = Field(600.0, description="per-attempt timeout")
    kv_migration: bool = Field(
        True,
        description="on drain, pin in-flight requests' KV at the source and have the destination take it over "
        "(off with api = vllm: vLLM pins no KV)",
    )
    kv_takeover_timeout_s: float = Field(
        30.0, description="how long a destination may take to read pinned KV"
    )
    kv_prefix_budget_s: float = Field(
        10.0,
        description="at drain, how long moving idle executions' cached contexts may take (the rest recompute)",
    )

    @model_validator(mode="after")
    def _no_kv_pins_on_vllm(self) -> EnginePoolConfig:
        # vLLM has no endpoint that pins one request's KV for another engine: a call moved off a vLLM engine is
        # recomputed where it goes, as on SGLang
        if self.api == "vllm":
            object.__setattr__(self, "kv_migration", False)
        return self


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
    cached_tokens: int | None = None
    migrated_tokens: int | None = None  # of cached_tokens, those from a KV takeover (engines that say so)
    first_at: float | None = None


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
    if isinstance(meta.get("cached_tokens"), int):
        att.cached_tokens = meta["cached_tokens"]
    if isinstance(meta.get("migrated_tokens"), int):
        att.migrated_tokens = meta["migrated_tokens"]
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


_JSON = {"content-type": "application/json"}  # vLLM refuses a body without it (415)


class EnginePool(KVMoves):
    """Least-loaded routing and retrying `/generate` calls over a set of engines."""

    HTTP_POOLS = 8

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
        # /generate streams go through HTTP_POOLS clients chosen by request id: httpcore scans every connection of
        # a pool (idle and expiry checks) each time a request starts or ends, so one pool of 256 busy connections
        # cost 39% of the proxy's CPU at 256 concurrent calls (py-spy); smaller pools make that scan short.
        self._streams = (
            [self._client]
            if client is not None
            else [self._client]
            + [
                httpx.AsyncClient(
                    timeout=httpx.Timeout(config.request_timeout_s, connect=5.0),
                    limits=httpx.Limits(
                        max_connections=1024,
                        max_keepalive_connections=256 // self.HTTP_POOLS,
                        keepalive_expiry=2.0,
                    ),
                    headers=headers,
                )
                for _ in range(self.HTTP_POOLS - 1)
            ]
        )
        self.retries = 0  # attempts beyond the first, over the pool's life (for /metrics)
        # vLLM: the weight version each engine last reported (it says only at a request's end)
        self._versions: dict[str, str] = {}
        # key (execution) -> its calls running now: what a stall watchdog counts as progress besides finished calls
        self.active: Counter[str] = Counter()
        self._pins: dict[str, asyncio.Future[dict[str, Any] | None]] = {}  # attempt rid -> KV export (drain)
        self.reroutes: deque[Reroute] = deque(maxlen=1024)
        # key (execution) -> (engine that served its last call, its full context, its route): for prefix migration
        # the token ids as array('i'): 4 bytes a token, where a list held an 8-byte pointer and a 28-byte int each
        self._contexts: OrderedDict[str, tuple[str, array, Any]] = OrderedDict()
        self.max_contexts = 4096
        self._prefix_moved: dict[
            str, Reroute
        ] = {}  # key -> its installed prefix migration, until its next call
        # key -> its prefix move at a drain, until that move ended (its next call waits for it)
        self._prefix_pending: dict[str, asyncio.Future[None]] = {}
        # bounds the token arrays kept, by their real size (LRU by execution)
        self.max_context_bytes = 64 << 20
        self._context_bytes = 0
        self.kv_stats: dict[str, float] = dict.fromkeys(
            (
                "reroutes",
                "migrated",
                "migrated_tokens",
                "served_tokens",
                "recomputed_tokens",
                "bytes",
                "first_token_s",
                "first_tokens",
            ),
            0,
        )  # totals over the pool's life (for /metrics); one `Reroute` per moved request in `reroutes`

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
        # contexts left here are claimed first: from now on their executions' next calls wait for their moves
        claims = {}
        if self.config.kv_migration:
            idle = [k for k, (served, _, _) in reversed(list(self._contexts.items())) if served == url]
            claims = {k: self._claim(k) for k in idle if k not in self._prefix_pending}
        try:
            if abort_inflight:
                for rid in list(st.inflight):
                    await self._pin_or_abort(url, rid)
            if self.config.kv_migration:
                await self._migrate_prefixes(url, claims)
        finally:  # however the drain ends, no call keeps waiting for a move that will not come
            for key, fut in claims.items():
                self._unclaim(key, fut)
        deadline = time.time() + timeout_s
        while st.inflight and time.time() < deadline:
            await asyncio.sleep(0.02)
        if not st.inflight:
            self._engines.pop(url, None)
        return n

    def _remember(self, key: str | None, url: str, tokens: list[int], route: Any) -> None:
        if key is None:
            return
        try:
            ids = array("i", tokens)
        except OverflowError:  # an id past int32 is no token of any vocabulary: nothing to migrate
            return
        old = self._contexts.pop(key, None)
        self._context_bytes += sys.getsizeof(ids) - (sys.getsizeof(old[1]) if old else 0)
        self._contexts[key] = (url, ids, route)
        while len(self._contexts) > 1 and (
            len(self._contexts) > self.max_contexts or self._context_bytes > self.max_context_bytes
        ):
            _, (_, dropped, _) = self._contexts.popitem(last=False)
            self._context_bytes -= sys.getsizeof(dropped)

    def context_bytes(self) -> int:
        """Bytes of the token arrays remembered for prefix migration (bounded by `max_context_bytes`)."""
        return self._context_bytes

    def forget(self, key: str) -> None:
        """Drop what the pool remembers of an execution (it ended)."""
        self._prefix_moved.pop(key, None)
        old = self._contexts.pop(key, None)
        if old is not None:
            self._context_bytes -= sys.getsizeof(old[1])

    def _pick(self, route: list[str] | None, prefer: str | None = None) -> _EngineState | None:
        """The least-loaded available engine of `route`; `prefer` wins when it is one of them (it holds KV)."""
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
        held = [s for s in cands if s.url == prefer]
        return held[0] if held else min(cands, key=lambda s: len(s.inflight)) if cands else None

    # ---- generation ------------------------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling: dict[str, Any],
        route: list[str] | Callable[[], list[str] | None] | None = None,
        rid: str | None = None,
        on_accept: Callable[[], None] | None = None,
        key: str | None = None,
    ) -> GenerateResult:
        """Generate up to `sampling["max_new_tokens"]` tokens after `input_ids`, retrying across engines.

        `route` may be a callable: it is read again before every attempt, so a call interrupted because its engine
        left rollout continues on the execution's *new* route, never back on the engine being drained.
        `on_accept` is called once, when an engine first answers the request with a success status (it accepted it).
        `key` (an execution id) remembers where the call's context lives, for prefix migration when that engine drains,
        and counts the call in `active` while it runs.
        """
        if key is None:
            return await self._generate(input_ids, sampling, route, rid, on_accept, key)
        self.active[key] += 1
        try:
            return await self._generate(input_ids, sampling, route, rid, on_accept, key)
        finally:
            self.active[key] -= 1
            if not self.active[key]:
                del self.active[key]

    async def _generate(
        self,
        input_ids: list[int],
        sampling: dict[str, Any],
        route: list[str] | Callable[[], list[str] | None] | None,
        rid: str | None,
        on_accept: Callable[[], None] | None,
        key: str | None,
    ) -> GenerateResult:
        if not isinstance(input_ids, list):
            input_ids = list(input_ids)
        res = GenerateResult()
        budget = int(sampling.get("max_new_tokens", 128))
        base = rid or uuid.uuid4().hex
        moved: tuple[dict[str, Any] | None, float] | None = (
            None  # (KV export, when) of the last drained attempt
        )
        if key is not None:  # its context may be (or have to be) moved first: start where it lands
            await self._follow(key, input_ids, route)
        # an execution whose context moved at a drain goes where the moved blocks are, when its route allows it
        moved_to = self._prefix_moved[key].destination if key in self._prefix_moved else None
        for attempt in range(self.config.max_attempts):
            res.attempts = attempt + 1
            st = self._pick(route() if callable(route) else route, moved_to if not attempt else None)
            if st is None:
                await asyncio.sleep(self.config.retry_backoff_s * (attempt + 1))
                continue
            if attempt:
                self.retries += 1
            reroute = None
            if moved is not None:
                export, t_moved = moved
                ctx = input_ids + res.output_ids
                if export is not None:
                    reroute = await self._takeover(st, export, ctx, base)
                else:
                    reroute = Reroute(base, "", st.url, len(ctx), "unavailable")
                moved = None
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
            # served from migrated blocks: what the engine says it took over, else (an engine that does not say)
            # what it had cached, which may also count its own prefix cache
            used = att.migrated_tokens if att.migrated_tokens is not None else att.cached_tokens
            moved_prefix = self._prefix_moved.pop(key, None) if key is not None and not attempt else None
            if moved_prefix is not None:  # the execution's first call since its context moved
                here = moved_prefix.destination == st.url
                moved_prefix.served_tokens = min(used or 0, moved_prefix.migrated_tokens) if here else 0
                moved_prefix.recomputed_tokens = moved_prefix.migrated_tokens - moved_prefix.served_tokens
                self.kv_stats["served_tokens"] += moved_prefix.served_tokens
                self.kv_stats["recomputed_tokens"] += moved_prefix.recomputed_tokens
            if reroute is not None:
                if used is not None and reroute.status == "installed":
                    reroute.served_tokens = min(used, reroute.migrated_tokens)
                    self.kv_stats["served_tokens"] += reroute.served_tokens
                if att.cached_tokens is not None:
                    reroute.recomputed_tokens = max(0, reroute.context_tokens - att.cached_tokens - 1)
                if att.first_at is not None:
                    reroute.first_token_s = att.first_at - t_moved
                self._record(reroute)
            if (st.draining and att.finish == "abort") or att_rid in self._pins:
                moved = (await self._export_for(att_rid), time.time())
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
                self._remember(key, st.url, input_ids + res.output_ids, route)
                return res
            if len(res.output_ids) >= budget:
                res.finish = "length"
                return res
            # aborted, killed or unreachable: continue from input + what was produced, on the current route
        raise EnginesExhausted(f"no engine finished the call after {self.config.max_attempts} attempts")

    async def _call(
        self, url: str, ids: list[int], sp: dict[str, Any], rid: str, att: _Attempt, res, on_accept=None
    ) -> None:
        if self.config.api == "vllm":
            path, body = vllm_wire.GENERATE_PATH, vllm_wire.generate_body(rid, ids, sp, self.config.stream)
            version = self._versions.get(url, "default")

            def apply(obj: dict[str, Any]) -> None:
                vllm_wire.apply_chunk(att, obj, version)
                if att.finish is not None and att.versions:
                    self._versions[url] = att.versions[-1]
        else:
            path, apply = "/generate", functools.partial(_apply, att)
            body = {
                "rid": rid,
                "input_ids": ids,
                "sampling_params": sp,
                "return_logprob": True,
                "logprob_start_len": -1,
                "stream": self.config.stream,
            }
        client = self._streams[hash(rid) % len(self._streams)]
        async with client.stream("POST", f"{url}{path}", content=orjson.dumps(body), headers=_JSON) as r:
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
                apply(orjson.loads(await r.aread()))
                att.first_at = time.time() if att.ids else None
                return
            async for payload in _sse_data(r):
                if payload == b"[DONE]":
                    # read on to the end of the response: one left unread closes its connection instead of going
                    # back to the pool (a new TCP connection per call was a tenth of the proxy's CPU, py-spy)
                    continue
                apply(orjson.loads(payload))
                if att.ids and att.first_at is None:
                    att.first_at = time.time()
                if att.ids and res.first_token_at is None:
                    res.first_token_at = time.time()
            if att.finish is None:  # stream ended without a finish reason: the engine went away
                raise httpx.RemoteProtocolError("stream ended early")

    async def context_length(self, url: str, timeout_s: float = 10.0) -> int | None:
        """The engine's context length from `GET /server_info` (`context_length`; SGLang reports it when set) or,
        from vLLM, `GET /v1/models` (`max_model_len`); None when the engine does not say or cannot be reached."""
        vllm = self.config.api == "vllm"
        try:
            r = await self._client.get(
                f"{url.rstrip('/')}{'/v1/models' if vllm else '/server_info'}", timeout=timeout_s
            )
            body = r.json() if r.status_code == 200 else None
            if vllm:
                value = body["data"][0].get("max_model_len") if body else None
            else:
                value = body.get("context_length") if body else None
        except (httpx.HTTPError, ValueError, AttributeError, KeyError, IndexError, TypeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    async def aclose(self) -> None:
        for client in self._streams:
            await client.aclose()


async def _sse_data(r: httpx.Response):
    """The `data:` payloads of a server-sent-event stream, as bytes. Split here rather than with `aiter_lines`, whose
    text decoding and line splitting were a sixth of the proxy's CPU per call (py-spy, 64 concurrent executions)."""
    buf = b""
    async for chunk in r.aiter_bytes():  # decoded (a compressed stream), not split into text lines
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if buf.startswith(b"data:"):
        yield buf[5:].strip()
