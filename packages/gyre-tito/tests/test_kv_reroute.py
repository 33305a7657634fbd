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
        "reroutes": 1, "migrated": 1, "migrated_tokens": 7, "served_tokens": 7, "recomputed_tokens": 0, "bytes": 4096,
        "first_token_s": None, "first_tokens": 1,
    }  # fmt: skip  # fmt: skip


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


async def case_moved_context_draws_the_next_call_to_its_engine() -> None:
    """An idle execution's context moves at the drain to the engine of its route that is free then (C, while B is
    busy); its next call goes to C although B is as free by then, and is served from the moved blocks (the engine's
    `migrated_tokens`, not its own prefix cache)."""
    C = "http://c"
    seen: list[tuple[str, str, Any]] = []
    moved = PROMPT + FIRST  # the first call's context, whole blocks of it cached at A

    async def handler(request: httpx.Request) -> httpx.Response:
        host, path = f"http://{request.url.host}", request.url.path
        body = orjson.loads(request.content) if request.content else None
        seen.append((host, path, body))
        if path == "/kv/pin":
            return httpx.Response(200, json={"migration_id": "m2", "peer": "x:1", "token_ids": moved})
        if path == "/kv/takeover":
            return httpx.Response(
                200, json={"migration_id": "m2", "status": "installed", "migrated_tokens": 8, "nbytes": 64}
            )
        ids = body["input_ids"]
        taken = 8 if host == C and ids[:8] == moved else 0  # C admits the call on the adopted sequence
        own = 5 if host == B else 0  # B has the task prompt in its own prefix cache: not migrated KV
        meta = {"finish_reason": {"type": "stop"}, "completion_tokens": 3, "cached_tokens": taken or own,
                "migrated_tokens": taken, "weight_version": "1", "output_token_logprobs": [[-0.5, 11 + i, None] for i in range(3)]}  # fmt: skip
        return httpx.Response(200, json={"output_ids": [11, 12, 13], "meta_info": meta})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    pool = EnginePool(EnginePoolConfig(engines=[A, B, C], retry_backoff_s=0.0, stream=False), client=client)
    route = [A]
    await pool.generate(PROMPT, {"max_new_tokens": 3}, route=lambda: route, key="x")
    route[:] = [B, C]  # the execution moves; B is busy with another call while A drains
    pool._engines[B].inflight["other"] = 0
    await pool.drain(A, timeout_s=10)
    del pool._engines[B].inflight["other"]
    await pool.generate([*moved, 30, 31], {"max_new_tokens": 3}, route=lambda: route, key="x")
    await pool.aclose()
    (rec,) = pool.reroutes
    assert (rec.kind, rec.status, rec.destination, rec.migrated_tokens) == ("prefix", "installed", C, 8)
    assert [h for h, p, _ in seen if p == "/generate"] == [A, C]
    assert rec.served_tokens == 8 and rec.recomputed_tokens == 0


def test_moved_context_draws_the_next_call_to_its_engine() -> None:
    asyncio.run(case_moved_context_draws_the_next_call_to_its_engine())
