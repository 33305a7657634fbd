"""KV-cache migration in the engine pool (docs/design/cells.md): the moves `EnginePool` makes when an engine drains or an
execution leaves the engine holding its context, and one `Reroute` record per move.

- In-flight calls: `drain` pins each call's KV at the source (`POST /kv/pin`, which ends the request) instead of a
  plain abort; the retry asks the destination to take the blocks over (`POST /kv/takeover`) before it sends the call.
- Contexts: an execution's last context (remembered per key) moves with it, at the drain (claimed first, moved all at
  once) or on its next call when its route no longer includes the engine holding it; that call waits for the move.
Any refusal or failure releases the pin and the call recomputes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from gyre_tito import vllm_wire

if TYPE_CHECKING:
    from gyre_tito.engine_client import EnginePoolConfig, _EngineState

__all__ = ["KVMoves", "Reroute"]


@dataclass
class Reroute:
    """One request moved off a drained engine: what the destination got from the source's KV, what it recomputed."""

    rid: str
    source: str
    destination: str
    context_tokens: int
    """Tokens of the retried prompt."""
    status: str
    """installed | refused | failed | unavailable (no pin: plain abort)."""
    migrated_tokens: int = 0
    recomputed_tokens: int | None = None
    """Context tokens computed again; None until known. In flight: the retried prompt less what the destination had
    cached (migrated or its own) less the last token. Prefix: the moved tokens the execution's next call did not get
    from the migrated blocks (all of them when that call ran on another engine or after a weight update)."""
    nbytes: int = 0
    takeover_s: float = 0.0
    first_token_s: float | None = None
    """From the reroute (the source's abort seen here) to the first token from the destination."""
    reason: str | None = None
    kind: str = "inflight"
    """inflight (a call cut mid-generation) | prefix (an execution's context moved between its calls)."""
    served_tokens: int | None = None
    """Migrated tokens the next call at the destination was served from (the engine reported them cached); None
    until that call ran (a prefix whose execution's next call landed on another engine stays 0)."""


class KVMoves:
    """Mixin of `EnginePool`: pins, takeovers and context moves, with their records and totals."""

    config: EnginePoolConfig
    _client: httpx.AsyncClient
    _engines: dict[str, _EngineState]
    _pins: dict[str, asyncio.Future[dict[str, Any] | None]]
    _contexts: OrderedDict[str, tuple[str, array, Any]]
    _prefix_moved: dict[str, Reroute]
    _prefix_pending: dict[str, asyncio.Future[None]]
    reroutes: deque[Reroute]
    kv_stats: dict[str, float]
    _pick: Callable[..., _EngineState | None]  # EnginePool's routing

    async def _pin_or_abort(self, url: str, rid: str) -> None:
        """End `rid` at `url`: pin its KV for a takeover (the engine ends the request), else a plain abort."""
        fut: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._pins[rid] = fut  # registered first: the retry may see the abort before the pin's answer arrives
        export = None
        vllm = self.config.api == "vllm"
        if self.config.kv_migration:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await self._client.post(f"{url}/kv/pin", json={"rid": rid}, timeout=5.0)
                if r.status_code == 200:
                    export = dict(r.json(), source_url=url)
        if not fut.done():
            fut.set_result(export)
        if export is None:
            self._pins.pop(rid, None)
            path, body = (
                (vllm_wire.ABORT_PATH, vllm_wire.abort_body(rid))
                if vllm
                else ("/abort_request", {"rid": rid, "abort_all": False})
            )
            with contextlib.suppress(httpx.HTTPError):
                await self._client.post(f"{url}{path}", json=body, timeout=5.0)

    def _claim(self, key: str) -> asyncio.Future[None]:
        """Mark `key`'s context as being moved: its next call waits until the future is done (see `_follow`)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._prefix_pending[key] = fut
        return fut

    async def _migrate_prefixes(self, url: str, claims: dict[str, asyncio.Future[None]]) -> None:
        """Move the reusable prefix of each execution whose last call `url` served (claimed when the drain began) to
        an engine of its route, all at once, within `kv_prefix_budget_s`."""
        deadline = time.monotonic() + self.config.kv_prefix_budget_s
        moves = []
        for key, fut in claims.items():
            ctx = self._contexts.get(key)
            if ctx is not None and ctx[0] == url:
                moves.append(self._move_prefix(url, key, ctx[1], ctx[2], fut, deadline))
            else:  # it ended meanwhile
                self._unclaim(key, fut)
        await asyncio.gather(*moves)

    def _unclaim(self, key: str, fut: asyncio.Future[None]) -> None:
        if self._prefix_pending.get(key) is fut:
            del self._prefix_pending[key]
        if not fut.done():
            fut.set_result(None)

    async def _move_prefix(
        self, url: str, key: str, tokens: array, route: Any, fut: asyncio.Future[None], deadline: float
    ) -> None:
        """Pin the cached prefix of `tokens` at `url` and have an engine of `route` take it over; the claim `fut` is
        released at the end however it ends (not installed: the next call recomputes)."""
        try:
            dest = self._pick(route() if callable(route) else route)
            if dest is None or dest.url == url or time.monotonic() > deadline:
                return
            try:
                r = await self._client.post(
                    f"{url}/kv/pin", json={"token_ids": tokens.tolist(), "abort": False}, timeout=5.0
                )
            except httpx.HTTPError:
                return  # the engine is gone: the next call recomputes
            if r.status_code != 200:
                return  # nothing cached for this execution, or no KV migration on this engine (404)
            rec = await self._takeover(dest, dict(r.json(), source_url=url), None, key)
            rec.context_tokens, rec.kind = len(tokens), "prefix"
            self._record(rec)
            current = self._contexts.get(key)  # the execution may have ended, or moved on meanwhile
            if rec.status == "installed" and current is not None and current[1] is tokens:
                self._contexts[key] = (dest.url, tokens, route)
                self._prefix_moved[key] = rec
        finally:
            self._unclaim(key, fut)

    async def _follow(self, key: str, input_ids: list[int], route: Any) -> None:
        """Before an execution's call: wait for its context's move if one runs; if its context lives on an engine its
        route no longer includes (the execution was moved; that engine may be about to drain), move it first, so the
        call starts from the moved blocks instead of recomputing them."""
        pending = self._prefix_pending.get(key)
        if pending is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(pending), self.config.kv_prefix_budget_s + 5.0)
            return
        ctx = self._contexts.get(key)
        if not self.config.kv_migration or ctx is None or key in self._prefix_moved:
            return
        src, tokens, _ = ctx
        urls = route() if callable(route) else route
        moved_off = urls is not None and src not in {u.rstrip("/") for u in urls} and src in self._engines
        if moved_off and len(input_ids) >= len(tokens) and array("i", input_ids[: len(tokens)]) == tokens:
            deadline = time.monotonic() + self.config.kv_prefix_budget_s
            await self._move_prefix(src, key, tokens, route, self._claim(key), deadline)

    async def _export_for(self, rid: str) -> dict[str, Any] | None:
        fut = self._pins.pop(rid, None)
        if fut is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), 10.0)
        except TimeoutError:
            return None

    async def _takeover(
        self, st: _EngineState, export: dict[str, Any], ids: list[int] | None, rid: str
    ) -> Reroute:
        """Ask `st` to take over the source's pinned KV; any failure releases the pin (the retry recomputes)."""
        src = str(export.get("source_url"))
        rec = Reroute(rid, src, st.url, len(ids or ()), "failed")
        t0 = time.perf_counter()
        if st.url == src:
            rec.status, rec.reason = "refused", "same engine"
        else:
            try:
                r = await self._client.post(
                    f"{st.url}/kv/takeover",
                    content=orjson.dumps({"export": export, "token_ids": ids}),
                    headers={"content-type": "application/json"},
                    timeout=self.config.kv_takeover_timeout_s + 5.0,
                )
                body = r.json() if r.status_code in (200, 409, 502) else {}
                rec.status = str(body.get("status", "failed"))
                rec.reason = body.get("reason") or (None if body else f"HTTP {r.status_code}")
                if rec.status == "installed":
                    rec.migrated_tokens, rec.nbytes = int(body["migrated_tokens"]), int(body["nbytes"])
            except (httpx.HTTPError, ValueError, KeyError) as e:
                rec.status, rec.reason = "failed", repr(e)
        rec.takeover_s = time.perf_counter() - t0
        # the source may still hold the pin: give it back now instead of at expiry
        if rec.status != "installed":
            with contextlib.suppress(httpx.HTTPError):
                await self._client.post(
                    f"{src}/kv/release", json={"migration_id": export.get("migration_id")}, timeout=5.0
                )
        return rec

    def _record(self, rec: Reroute) -> None:
        self.reroutes.append(rec)
        k = self.kv_stats
        k["reroutes"] += 1
        k["migrated"] += rec.status == "installed"
        k["migrated_tokens"] += rec.migrated_tokens
        k["recomputed_tokens"] += rec.recomputed_tokens or 0
        k["bytes"] += rec.nbytes
        if rec.first_token_s is not None:
            k["first_token_s"] += rec.first_token_s
            k["first_tokens"] += 1
