"""The engine pool's reroute path with KV-cache migration, against scripted engines (httpx MockTransport).

Source `a` streams three tokens and then holds until it is asked to pin or abort the request; destination `b`
answers `/kv/takeover` as configured and then serves the rest. Real engines: gyre-cell's tests/test_kv_reroute_engines.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from gyre_tito.engine_client import EnginePool, EnginePoolConfig

A, B = "http://a", "http://b"
PROMPT = [5, 6, 7, 8, 9]
FIRST = [11, 12, 13]


class Engines:
    def __init__(self, *, pin: int = 200, takeover: tuple[int, str] = (200, "installed")) -> None:
        self.pin_status, self.takeover = pin, takeover
        self.calls: list[tuple[str, str, Any]] = []
        self.streamed = asyncio.Event()
        self.ended = asyncio.Event()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = f"http://{request.url.host}", request.url.path
        body = orjson.loads(request.content) if request.content else None
        self.calls.append((host, path, body))
        if host == A and path == "/generate":
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=self._stream(body)
            )
        if host == A and path == "/kv/pin":
            if self.pin_status != 200:
                return httpx.Response(self.pin_status, json={"detail": "Not Found"})
            self.ended.set()
            export = {"migration_id": "m1", "peer": "127.0.0.1:1", "token_ids": PROMPT + FIRST[:-1]}
            return httpx.Response(200, json=export)
        if host == A and path in ("/abort_request", "/kv/release"):
            self.ended.set()
            return httpx.Response(200, json={})
        if host == B and path == "/kv/takeover":
            status, kind = self.takeover
            n = len(body["export"]["token_ids"])
            res = {"migration_id": "m1", "status": kind, "migrated_tokens": n if kind == "installed" else 0}
            res["nbytes"] = 4096 if kind == "installed" else 0
            res["reason"] = None if kind == "installed" else "weight version '1' (source) != '2' (here)"
            return httpx.Response(status, json=res)
        if host == B and path == "/generate":
            ids = body["input_ids"]
            n = body["sampling_params"]["max_new_tokens"]
            cached = len(ids) - 1 if self.takeover[1] == "installed" and self.pin_status == 200 else 0
            meta = {
                "finish_reason": {"type": "length", "length": n},
                "completion_tokens": n,
                "cached_tokens": cached,
                "weight_version": "1",
                "output_token_logprobs": [[-0.5, 20 + i, None] for i in range(n)],
            }
            return httpx.Response(200, json={"output_ids": [20 + i for i in range(n)], "meta_info": meta})
        return httpx.Response(404, json={"detail": "Not Found"})

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        def frame(n: int, finish: dict[str, Any] | None) -> bytes:
            meta = {
                "finish_reason": finish,
                "completion_tokens": n,
                "weight_version": "1",
                "output_token_logprobs": [[-0.1, t, None] for t in FIRST[:n]],
            }
            return b"data: " + orjson.dumps({"output_ids": FIRST[:n], "meta_info": meta}) + b"\n\n"

        for n in range(1, len(FIRST) + 1):
            yield frame(n, None)
        self.streamed.set()
        await self.ended.wait()  # held mid-decode until the pool pins or aborts the request
        yield frame(len(FIRST), {"type": "abort", "message": "Migrating"})
        yield b"data: [DONE]\n\n"

    def paths(self, host: str) -> list[str]:
        return [p for h, p, _ in self.calls if h == host]


async def reroute(engines: Engines) -> tuple[EnginePool, Any]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines.handler))
    pool = EnginePool(EnginePoolConfig(engines=[A, B], retry_backoff_s=0.0), client=client)
    route = [A]
    task = asyncio.create_task(
        pool.generate(PROMPT, {"max_new_tokens": 8, "temperature": 1.0}, route=lambda: route, rid="call")
    )
    await asyncio.wait_for(engines.streamed.wait(), 10)
    route[:] = [B]  # the controller moved the execution, then drains the source at the proxy
    n = await pool.drain(A, timeout_s=10)
    assert n == 1
    res = await asyncio.wait_for(task, 10)
    await pool.aclose()
    return pool, res


async def case_drain_pins_then_destination_takes_over_before_the_retry() -> None:
    engines = Engines()
    pool, res = await reroute(engines)
    assert engines.paths(A) == ["/generate", "/kv/pin"]  # no plain abort: the pin ended the request
    assert engines.paths(B) == ["/kv/takeover", "/generate"]
    takeover = next(b for h, p, b in engines.calls if p == "/kv/takeover")
    assert takeover["export"]["source_url"] == A and takeover["export"]["migration_id"] == "m1"
    assert takeover["token_ids"] == PROMPT + FIRST
    retry = next(b for h, p, b in engines.calls if h == B and p == "/generate")
    assert retry["input_ids"] == PROMPT + FIRST and retry["sampling_params"]["max_new_tokens"] == 5
    assert res.output_ids == [*FIRST, 20, 21, 22, 23, 24] and res.finish == "length"
    assert [(s.engine, s.start, s.end) for s in res.segments] == [(A, 0, 3), (B, 3, 8)]
    (rec,) = pool.reroutes
    assert (rec.source, rec.destination, rec.status) == (A, B, "installed")
    assert rec.migrated_tokens == len(PROMPT) + 2 and rec.recomputed_tokens == 0 and rec.nbytes == 4096
    assert rec.context_tokens == len(PROMPT) + 3
    assert rec.first_token_s is not None and rec.first_token_s >= rec.takeover_s
    stats = dict(pool.kv_stats, first_token_s=None)
    assert stats == {
        "reroutes": 1,
        "migrated": 1,
        "migrated_tokens": 7,
        "served_tokens": 7,
        "recomputed_tokens": 0,
        "bytes": 4096,
        "first_token_s": None,
        "first_tokens": 1,
    }


async def case_engine_without_kv_pin_is_aborted_and_the_destination_recomputes() -> None:
    engines = Engines(pin=404)
    pool, res = await reroute(engines)
    assert engines.paths(A) == ["/generate", "/kv/pin", "/abort_request"]
    assert engines.paths(B) == ["/generate"]  # no takeover attempted
    assert res.output_ids == [*FIRST, 20, 21, 22, 23, 24]
    (rec,) = pool.reroutes
    assert rec.status == "unavailable" and rec.migrated_tokens == 0
    assert rec.recomputed_tokens == len(PROMPT) + 2


async def case_refused_takeover_releases_the_pin_and_recomputes() -> None:
    engines = Engines(takeover=(409, "refused"))
    pool, res = await reroute(engines)
    assert engines.paths(A) == ["/generate", "/kv/pin", "/kv/release"]
    release = next(b for h, p, b in engines.calls if h == A and p == "/kv/release")
    assert release == {"migration_id": "m1"}
    assert engines.paths(B) == ["/kv/takeover", "/generate"]
    assert res.output_ids == [*FIRST, 20, 21, 22, 23, 24]
    (rec,) = pool.reroutes
    assert (
        rec.status == "refused"
        and "weight version" in rec.reason
        and rec.recomputed_tokens == len(PROMPT) + 2
    )


async def case_migration_off_sends_a_plain_abort() -> None:
    engines = Engines()
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines.handler))
    pool = EnginePool(
        EnginePoolConfig(engines=[A, B], retry_backoff_s=0.0, kv_migration=False), client=client
    )
    route = [A]
    task = asyncio.create_task(pool.generate(PROMPT, {"max_new_tokens": 8}, route=lambda: route))
    await asyncio.wait_for(engines.streamed.wait(), 10)
    route[:] = [B]
    await pool.drain(A, timeout_s=10)
    res = await asyncio.wait_for(task, 10)
    await pool.aclose()
    assert engines.paths(A) == ["/generate", "/abort_request"] and engines.paths(B) == ["/generate"]
    assert len(res.output_ids) == 8 and pool.reroutes[0].status == "unavailable"


def test_drain_pins_then_destination_takes_over_before_the_retry() -> None:
    asyncio.run(case_drain_pins_then_destination_takes_over_before_the_retry())


def test_engine_without_kv_pin_is_aborted_and_the_destination_recomputes() -> None:
    asyncio.run(case_engine_without_kv_pin_is_aborted_and_the_destination_recomputes())


def test_refused_takeover_releases_the_pin_and_recomputes() -> None:
    asyncio.run(case_refused_takeover_releases_the_pin_and_recomputes())


def test_migration_off_sends_a_plain_abort() -> None:
    asyncio.run(case_migration_off_sends_a_plain_abort())


C = "http://c"
MOVED = PROMPT + FIRST  # the first call's context: A holds its KV


class ContextEngines:
    """Engines for moves of an idle execution's context: A serves the first call and pins its context, B and C take
    it over (optionally held at `gate`) and report on each call how many tokens came from a takeover
    (`migrated_tokens`, 8 when the call starts with the moved context there); B also has the prompt in its own
    prefix cache (`cached_tokens` 5, not migrated)."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.gate, self.takeover_started = gate, asyncio.Event()
        self.installed: set[str] = set()
        self.generated: list[str] = []
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler))
        self.pool = EnginePool(
            EnginePoolConfig(engines=[A, B, C], retry_backoff_s=0.0, stream=False), client=client
        )

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = f"http://{request.url.host}", request.url.path
        body = orjson.loads(request.content) if request.content else None
        if path == "/kv/pin":
            return httpx.Response(200, json={"migration_id": "m2", "peer": "x:1", "token_ids": MOVED})
        if path == "/kv/takeover":
            self.takeover_started.set()
            if self.gate is not None:
                await self.gate.wait()  # the move is under way until the test opens the gate
            self.installed.add(host)
            return httpx.Response(
                200, json={"migration_id": "m2", "status": "installed", "migrated_tokens": 8, "nbytes": 64}
            )
        self.generated.append(host)
        taken = 8 if host in self.installed and body["input_ids"][:8] == MOVED else 0
        own = 5 if host == B else 0
        meta = {
            "finish_reason": {"type": "stop"},
            "completion_tokens": 3,
            "cached_tokens": taken or own,
            "migrated_tokens": taken,
            "weight_version": "1",
            "output_token_logprobs": [[-0.5, 11 + i, None] for i in range(3)],
        }
        return httpx.Response(200, json={"output_ids": [11, 12, 13], "meta_info": meta})


async def case_moved_context_draws_the_next_call_to_its_engine() -> None:
    """An idle execution's context moves at the drain to the engine of its route that is free then (C, while B is
    busy); its next call goes to C although B is as free by then, and is served from the moved blocks (the engine's
    `migrated_tokens`, not its own prefix cache)."""
    e = ContextEngines()
    pool, route = e.pool, [A]
    await pool.generate(PROMPT, {"max_new_tokens": 3}, route=lambda: route, key="x")
    route[:] = [B, C]  # the execution moves; B is busy with another call while A drains
    pool._engines[B].inflight["other"] = 0
    await pool.drain(A, timeout_s=10)
    del pool._engines[B].inflight["other"]
    await pool.generate([*MOVED, 30, 31], {"max_new_tokens": 3}, route=lambda: route, key="x")
    await pool.aclose()
    (rec,) = pool.reroutes
    assert (rec.kind, rec.status, rec.destination, rec.migrated_tokens) == ("prefix", "installed", C, 8)
    assert e.generated == [A, C]
    assert rec.served_tokens == 8 and rec.recomputed_tokens == 0


async def case_next_call_waits_for_its_contexts_move() -> None:
    """A call of an execution whose context is still being moved at a drain waits for that move to end, then goes
    where the context landed (it does not race the move and recompute)."""
    gate = asyncio.Event()
    e = ContextEngines(gate)
    pool, route, reads = e.pool, [A], []

    def current_route() -> list[str]:
        reads.append(gate.is_set())  # when the call picks its engine: before or after the move ended
        return route

    await pool.generate(PROMPT, {"max_new_tokens": 3}, route=current_route, key="x")
    route[:] = [B, C]
    pool._engines[B].inflight["other"] = 0  # B busy while A drains: the context goes to C
    drain = asyncio.create_task(pool.drain(A, timeout_s=10))
    await asyncio.wait_for(e.takeover_started.wait(), 10)
    del pool._engines[B].inflight["other"]
    reads.clear()
    nxt = asyncio.create_task(
        pool.generate([*MOVED, 30], {"max_new_tokens": 3}, route=current_route, key="x")
    )
    await asyncio.sleep(0)  # one yield: the new call runs up to its first suspension (not a timed wait)
    assert pool.active == {"x": 1}  # a call of x runs (what a stall watchdog reads as progress)
    gate.set()
    await asyncio.wait_for(drain, 10)
    await asyncio.wait_for(nxt, 10)
    assert not pool.active
    await pool.aclose()
    assert reads and reads[0] is True  # it picked its engine only once the move had ended
    assert e.generated == [A, C]
    (rec,) = pool.reroutes
    assert rec.served_tokens == 8 and rec.recomputed_tokens == 0


async def case_rerouted_execution_takes_its_context_along() -> None:
    """An execution moved to another engine before its old one drains (the controller reroutes first): its next
    call moves its context there first (pin at A, takeover at C) and is served from it; no drain needed."""
    e = ContextEngines()
    pool, route = e.pool, [A]
    await pool.generate(PROMPT, {"max_new_tokens": 3}, route=lambda: route, key="x")
    route[:] = [C]
    await pool.generate([*MOVED, 30], {"max_new_tokens": 3}, route=lambda: route, key="x")
    await pool.generate([*MOVED, 30, 11, 12, 13, 31], {"max_new_tokens": 3}, route=lambda: route, key="x")
    await pool.aclose()
    (rec,) = pool.reroutes  # one move: the call after it finds its context at C already
    assert (rec.kind, rec.source, rec.destination, rec.status) == ("prefix", A, C, "installed")
    assert e.generated == [A, C, C] and rec.served_tokens == 8 and rec.recomputed_tokens == 0


def test_moved_context_draws_the_next_call_to_its_engine() -> None:
    asyncio.run(case_moved_context_draws_the_next_call_to_its_engine())


def test_next_call_waits_for_its_contexts_move() -> None:
    asyncio.run(case_next_call_waits_for_its_contexts_move())


def test_rerouted_execution_takes_its_context_along() -> None:
    asyncio.run(case_rerouted_execution_takes_its_context_along())
