"""The engine client reads a streamed /generate to its end (so the connection goes back to the pool) and splits
server-sent events itself."""

from __future__ import annotations

import asyncio

import httpx
import orjson

from gyre_tito import engine_client
from gyre_tito.conversation import Conversation, Sampling, Turn
from gyre_tito.proxy import Proxy, ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer


def test_sse_payloads_split_across_chunks():
    events = [b'data: {"a": 1}\n\n', b": keep-alive\n\n", b'data: {"b": 2}\r\n\r\n', b"data: [DONE]\n\n"]
    raw = b"".join(events)
    chunks = [raw[i : i + 7] for i in range(0, len(raw), 7)]  # lines cut anywhere

    async def run() -> list[bytes]:
        r = httpx.Response(200, stream=httpx.ByteStream(b""))
        r.stream = _Chunks(chunks)
        return [p async for p in engine_client._sse_data(r)]

    assert asyncio.run(run()) == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
    assert orjson.loads(b'{"a": 1}') == {"a": 1}


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for c in self.chunks:
            yield c


def test_sequential_calls_reuse_engine_connections(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), default_reply="Hi."))
    url = eng.start()
    proxy = Proxy(ProxyConfig(engines=[url], tokenizer=str(tok), store=str(tmp_path / "s"), fsync=False))
    ex, _ = proxy.register("ex")

    async def run() -> list[int]:
        for k in range(20):
            conv = Conversation(None, [Turn("user", f"q{k}")], [])
            await proxy.complete(ex, conv, Sampling(max_new_tokens=8), "anthropic", {})
        kept = [len(c._transport._pool.connections) for c in proxy.pool._streams]  # httpcore's pools
        await proxy.aclose()
        return kept

    try:
        kept = asyncio.run(run())
        # each pool the calls went through kept its one connection alive for the next call (was: none, each
        # call's connection was closed and the next one opened a new one)
        assert 1 <= sum(kept) <= len(kept) < 20 and max(kept) == 1
    finally:
        eng.stop()


def test_concurrent_calls_ask_an_engine_for_its_context_length_once(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    proxy = Proxy(
        ProxyConfig(engines=["http://e:1"], tokenizer=str(tok), store=str(tmp_path / "s"), fsync=False)
    )
    asked: list[str] = []

    async def run() -> list[int]:
        gate = asyncio.Event()

        async def context_length(url: str) -> int:
            asked.append(url)
            await gate.wait()  # every call below arrives while the first question is unanswered
            return 4096

        proxy.pool.context_length = context_length
        calls = [asyncio.ensure_future(proxy.context_limit(None)) for _ in range(20)]
        while len(asked) < 1:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # let every call reach the question
        gate.set()
        return await asyncio.gather(*calls)

    assert asyncio.run(run()) == [4096] * 20
    assert asked == ["http://e:1"]  # once (was: once per call)
