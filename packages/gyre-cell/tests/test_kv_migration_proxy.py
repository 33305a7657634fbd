"""KV migration through gyre-tito's reroute path (EnginePool.drain + retry) between two real torch engines, and the
RolloutEngine clients' capability flag."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gyre_cell.client import TorchEngineClient
from gyre_cell.engine.core import TorchEngine
from gyre_cell.errors import EngineError
from gyre_cell.sglang_adapter import SGLangEngine
from gyre_tito.engine_client import EnginePool, EnginePoolConfig

PROMPT = [(13 * i + 1) % 490 + 3 for i in range(40)]
N_NEW = 16
SP = {"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}
SMALL = {"max_total_tokens": 2048, "cpu_threads": 1}


@pytest.fixture
def pair(tiny_model: Path, serve_engine: Any) -> Iterator[tuple[Any, Any]]:
    with serve_engine(tiny_model, **SMALL) as src, serve_engine(tiny_model, **SMALL) as dst:
        yield src, dst


def hold_after_any(engine: TorchEngine, k: int) -> threading.Event:
    """Pause `engine` in the step that gives any request its k-th token."""
    held = threading.Event()
    orig = engine._check_finish

    def check(req: Any, token: int) -> Any:
        out = orig(req, token)
        if len(req.output_ids) == k and out is None:
            engine.paused = True
            held.set()
        return out

    engine._check_finish = check  # type: ignore[method-assign]
    return held


def test_drained_call_continues_on_migrated_blocks(pair: tuple[Any, Any]) -> None:
    src, dst = pair
    ref = src.http.post(
        "/generate", json={"input_ids": PROMPT, "sampling_params": SP, "return_logprob": True}
    ).json()
    assert src.http.post("/flush_cache").status_code == 200
    held = hold_after_any(src.engine, 7)

    async def run() -> tuple[Any, EnginePool]:
        pool = EnginePool(EnginePoolConfig(engines=[src.url, dst.url], retry_backoff_s=0.0))
        route = [src.url]
        task = asyncio.create_task(pool.generate(PROMPT, dict(SP), route=lambda: route, rid="exec-1/0"))
        assert await asyncio.to_thread(held.wait, 60)
        route[:] = [dst.url]  # the controller moved the execution, then drains the source at the proxy
        await pool.drain(src.url, timeout_s=60)
        res = await asyncio.wait_for(task, 60)
        await pool.aclose()
        return res, pool

    m0 = dst.http.get("/kv/migrations").json()
    res, pool = asyncio.run(run())
    src.engine.resume_generation()
    m1 = dst.http.get("/kv/migrations").json()
    assert res.output_ids == ref["output_ids"]
    want = [t[0] for t in ref["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(res.logprobs, want, strict=True)) <= 1e-5
    assert [(s.engine, s.start, s.end) for s in res.segments] == [(src.url, 0, 7), (dst.url, 7, N_NEW)]
    (rec,) = pool.reroutes
    assert rec.status == "installed", rec.reason
    assert rec.migrated_tokens == len(PROMPT) + 6 and rec.recomputed_tokens == 0 and rec.nbytes > 0
    assert rec.served_tokens == len(PROMPT) + 6 and pool.kv_stats["served_tokens"] == len(PROMPT) + 6
    assert rec.first_token_s is not None
    assert m1["context_prefill_tokens_total"] - m0["context_prefill_tokens_total"] == 0
    assert m1["stats"]["migrated_tokens_used"] - m0["stats"]["migrated_tokens_used"] == len(PROMPT) + 6
    src_m = src.http.get("/kv/migrations").json()
    assert src_m["pins"] == [] and src_m["stats"]["pins_acked"] == 1
    assert src.http.get("/v1/loads").json()["loads"][0]["num_used_tokens"] == 0


def test_clients_report_the_capability_and_drive_a_prefix_migration(pair: tuple[Any, Any]) -> None:
    src, dst = pair
    assert TorchEngineClient.supports_kv_migration and not SGLangEngine.supports_kv_migration
    src.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": SP})  # its prefix stays cached

    async def run() -> dict[str, Any]:
        async with TorchEngineClient(src.url) as s, TorchEngineClient(dst.url) as d:
            export = await s.kv_pin(token_ids=PROMPT)  # an execution's reusable prefix, between its calls
            assert export["source_url"] == src.url and len(export["token_ids"]) == 32
            return await d.kv_takeover(export, token_ids=PROMPT)

    res = asyncio.run(run())
    assert res["status"] == "installed" and res["migrated_tokens"] == 32
    out = dst.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": SP}).json()
    assert out["meta_info"]["migrated_tokens"] == 32 and out["meta_info"]["cached_tokens"] == 32

    async def sglang() -> None:
        async with SGLangEngine("http://127.0.0.1:9") as e:
            with pytest.raises(EngineError) as err:
                await e.kv_pin(rid="x")
            assert err.value.status == 501

    asyncio.run(sglang())


def test_drain_moves_an_idle_executions_prefix_and_its_next_call_uses_it(pair: tuple[Any, Any]) -> None:
    src, dst = pair
    turn2 = [(5 * i + 2) % 480 + 9 for i in range(12)]

    async def run() -> tuple[Any, Any, EnginePool]:
        pool = EnginePool(EnginePoolConfig(engines=[src.url, dst.url], retry_backoff_s=0.0))
        route = [src.url]
        first = await pool.generate(PROMPT, dict(SP), route=lambda: route, key="exec-7")
        route[:] = [dst.url]  # role switch: the execution moves, then the source drains (nothing in flight)
        await pool.drain(src.url, timeout_s=30)
        context = PROMPT + first.output_ids + turn2  # the next call: previous context + output + a new turn
        second = await pool.generate(context, dict(SP), route=lambda: route, key="exec-7")
        await pool.aclose()
        return first, second, pool

    m0 = dst.http.get("/kv/migrations").json()
    first, second, pool = asyncio.run(run())
    m1 = dst.http.get("/kv/migrations").json()
    (rec,) = pool.reroutes
    assert rec.kind == "prefix" and rec.status == "installed", rec.reason
    # whole blocks of the first call's context were cached at the source
    full = (len(PROMPT) + N_NEW) // 16 * 16
    assert rec.migrated_tokens == full and rec.source == src.url and rec.destination == dst.url
    assert rec.served_tokens == full and pool.kv_stats["served_tokens"] == full  # the next call used them
    assert rec.recomputed_tokens == 0 and pool.kv_stats["recomputed_tokens"] == 0
    assert m1["stats"]["migrated_tokens_used"] - m0["stats"]["migrated_tokens_used"] == full
    computed = len(PROMPT) + N_NEW + len(turn2) - full
    assert m1["prefill_tokens_total"] - m0["prefill_tokens_total"] == computed
    assert src.http.get("/kv/migrations").json()["pins"] == []
    # the same call served by the source (its own cache) gives the same tokens
    ref = src.http.post(
        "/generate", json={"input_ids": PROMPT + first.output_ids + turn2, "sampling_params": SP}
    ).json()
    assert second.output_ids == ref["output_ids"]
