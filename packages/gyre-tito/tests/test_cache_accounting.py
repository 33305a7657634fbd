"""The proxy's shared caches count what they hold (issue 37): after 150 unique 120 KB executions had ended the proxy
kept +215-300 MB, its two 64 MiB encoding caches resident at 1.7-2.4x what they counted.

Deterministic accounting, no RSS: what a cache keeps alive once its callers let go (tracemalloc, counting only what
the code under test and this file allocated: CI once saw a thread another test left running in the same worker
push the process-wide figure 67 bytes past the bound) is at most what it counts, and an ended execution's remembered context is released. Before the fix the encoding cache held each text
whole as its key, counted at one byte a character (a CJK text takes two or four), and its ids with the spare room
of their growth; the engine pool held contexts as lists of ints (36 bytes a token) counted in tokens."""

from __future__ import annotations

import gc
import sys
import tracemalloc
from array import array

import httpx
import pytest

from gyre_tito import engine_client, render
from gyre_tito.engine_client import EnginePool, EnginePoolConfig
from gyre_tito.proxy import ProxyConfig
from gyre_tito.render import ByteLRU
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

SLACK = 4096
"""The cache object and its lock, and whether an object came from a free list (120-256 bytes measured)."""


def _grown(n: int, seed: int) -> array:
    ids = array("i", [seed])
    ids.extend(array("i", range(seed, seed + n)))  # grown as the encoder grows them: spare room at the end
    return ids


_OURS = [tracemalloc.Filter(True, f) for f in (render.__file__, engine_client.__file__, __file__)]


def _traced() -> int:
    """Bytes alive now that were allocated in the caches' modules or this file, whichever thread runs beside."""
    return sum(t.size for t in tracemalloc.take_snapshot().filter_traces(_OURS).traces)


def _kept_alive(build) -> tuple[object, int]:
    """Run `build()` under tracemalloc; what the returned object keeps alive once everything else is gone."""
    gc.collect()
    tracemalloc.start()
    try:
        base = _traced()
        obj = build()
        gc.collect()
        return obj, _traced() - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("alphabet", ["lorem ipsum ", "日本語のテキスト", "emoji 🙂 "])
def test_the_encoding_cache_counts_at_least_what_it_keeps_alive(alphabet):
    def build() -> ByteLRU:
        cache = ByteLRU(64 << 20)
        for i in range(300):
            text = f"{i} " + alphabet * (50 + i * 3)  # unique texts, dropped by the caller after the put
            cache.put(text, _grown(20 + i * 5, i))
        return cache

    cache, held = _kept_alive(build)
    assert len(cache) == 300
    assert held <= cache.nbytes + SLACK, (held, cache.nbytes)
    assert cache.nbytes <= 2 * held + SLACK  # and not wildly more: the bound is about the real bytes


def test_the_encoding_cache_stays_within_its_budget_by_what_it_holds():
    budget = 256 << 10

    def build() -> ByteLRU:
        cache = ByteLRU(budget)
        for i in range(600):
            cache.put(f"{i} " + "日本語" * 200, _grown(300, i))
        return cache

    cache, held = _kept_alive(build)
    assert 0 < len(cache) < 600 and cache.nbytes <= budget
    assert held <= cache.nbytes + SLACK, (held, cache.nbytes)  # a fixed 160 bytes a slot kept ~4.6 KB more
    text = "599 " + "日本語" * 200
    assert cache.get(text) is not None and list(cache.get(text)) == list(_grown(300, 599))
    assert cache.get("0 " + "日本語" * 200) is None  # the oldest went first


def test_the_pool_counts_its_contexts_by_their_bytes_and_forgets_an_ended_execution():
    pool = EnginePool(EnginePoolConfig(engines=["http://127.0.0.1:9"]))
    pool.max_context_bytes = 1 << 20
    gc.collect()
    tracemalloc.start()
    try:
        base = _traced()
        for e in range(3):
            pool._remember(f"e{e}", "http://127.0.0.1:9", list(range(e, e + 50_000)), None)
        gc.collect()
        held = _traced() - base
        assert held <= pool.context_bytes() + SLACK, (held, pool.context_bytes())
        assert len(pool._contexts) == 3 and pool.context_bytes() <= 3 * (4 * 50_000 + 100)
        for e in range(3):  # the executions end
            pool.forget(f"e{e}")
        gc.collect()
        left = _traced() - base
    finally:
        tracemalloc.stop()
    assert pool.context_bytes() == 0 and not pool._contexts
    assert left <= SLACK, left  # the arrays were released, not only uncounted

    for e in range(10):  # 10 contexts of 200 KB against a 1 MiB bound: the oldest go
        pool._remember(f"x{e}", "http://127.0.0.1:9", list(range(50_000)), None)
    assert (
        pool.context_bytes() <= pool.max_context_bytes
        and "x9" in pool._contexts
        and "x0" not in pool._contexts
    )


def test_an_ended_execution_leaves_no_remembered_context(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    engine = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), default_reply="ok " * 5))
    url = engine.start()
    cfg = ProxyConfig(engines=[url], tokenizer=str(tok), store=str(tmp_path / "store"), admin_token="adm")
    try:
        with ProxyServer(cfg) as srv:
            eid, cred = srv.register("e0")
            body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi " * 500}]}
            r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": cred}, json=body, timeout=60)
            assert r.status_code == 200, r.text
            contexts = srv.proxy.pool._contexts
            assert isinstance(contexts[eid][1], array) and srv.proxy.pool.context_bytes() == sys.getsizeof(
                contexts[eid][1]
            )
            srv.admin("POST", f"/admin/executions/{eid}/end")
            assert eid not in contexts and srv.proxy.pool.context_bytes() == 0
    finally:
        engine.stop()
