"""TITO proxy benchmark: per-call proxy overhead vs context length, and calls/s with 64 concurrent executions.

Part 1 (overhead): one Claude-Code-shaped execution grows by ~1k new tokens per call (a tool result) up to 128k
tokens. At each checkpoint the next call's proxy work is timed on fresh tails: parse the request, restore recorded
outputs, render, encode incrementally, match the tree. The baseline, in the same run, re-renders the whole conversation
and re-tokenizes it from scratch (what a naive proxy does), then matches. Engine time is not part of either.

Part 2 (throughput): 64 executions run concurrent agent loops over HTTP against the proxy on the scripted engine;
baseline: the same number of calls sent straight to the scripted engine's /generate.

Times are the measuring thread's CPU time (`time.thread_time`), so other processes on a shared machine do not inflate
them; wall-clock p50 is reported alongside. Last line: one JSON object. `--quick` stops at 16k tokens, fewer calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from gyre_tito import anthropic_api
from gyre_tito.conversation import DEFAULT_VOLATILE_PATTERNS
from gyre_tito.proxy import Proxy, ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

TOOLS = [
    {
        "name": n,
        "description": f"The {n} tool. " * 20,
        "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}},
    }
    for n in ("Bash", "Read", "Write", "Edit", "Glob", "Grep")
]
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=9.9.9.abc; cc_entrypoint=sdk-cli;"},
    {
        "type": "text",
        "text": "You are an interactive agent that helps users with software engineering tasks. " * 3,
    },
]


def _tool_output(seed: int, n_tokens: int, chars_per_token: float) -> str:
    words = []
    i = seed * 7919
    while len(" ".join(words)) < n_tokens * chars_per_token:
        i = (i * 1103515245 + 12345) % 2**31
        words.append(f"f{i % 100000}.py:{i % 997} ok")
    return "\n".join(" ".join(words[j : j + 8]) for j in range(0, len(words), 8))


def _body(history: list[dict]) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "max_tokens": 1000,
            "system": SYSTEM,
            "tools": TOOLS,
            "messages": history,
            "stream": True,
        }
    )


def _naive(proxy: Proxy, ex, raw: bytes) -> int:
    """Baseline: full re-render (harness's copy of every turn) and full re-tokenization, then match."""
    conv, _, _ = anthropic_api.parse_request(orjson.loads(raw), DEFAULT_VOLATILE_PATTERNS)
    text = proxy.chat.render(conv.template_messages(lambda t: None), conv.tools)
    ids = proxy.chat.tokenizer.encode(text, add_special_tokens=False).ids
    ex.records.match(ids)
    return len(ids)


def _incremental(proxy: Proxy, ex, raw: bytes) -> int:
    conv, _, _ = anthropic_api.parse_request(orjson.loads(raw), DEFAULT_VOLATILE_PATTERNS, ex.turn_cache)
    ids, _ = proxy.encode(ex, conv)
    ex.records.match(ids)
    return len(ids)


def overhead(tok_dir: Path, work: Path, max_ctx: int, trials: int) -> dict:
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), default_reply=CALL))
    url = eng.start()
    proxy = Proxy(
        ProxyConfig(
            engines=[url],
            tokenizer=str(tok_dir),
            store=str(work / "ov"),
            fsync=False,
            max_context_tokens=262144,
        )
    )
    ex, _ = proxy.register("bench")
    probe = _tool_output(0, 1000, 3.0)
    cpt = len(probe) / len(proxy.chat.encode_text(probe))  # calibrate: 1k new tokens per call
    history: list[dict] = [{"role": "user", "content": "Fix the failing tests."}]
    checkpoints = [c for c in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072) if c <= max_ctx]
    rows = []
    loop = asyncio.new_event_loop()
    k = 0
    while checkpoints:
        raw = _body(history)
        conv, sampling, _ = anthropic_api.parse_request(orjson.loads(raw), DEFAULT_VOLATILE_PATTERNS)
        reply, _rec = loop.run_until_complete(
            proxy.complete(ex, conv, sampling, "anthropic", {}, orjson.loads(raw))
        )
        ctx = reply.input_tokens + reply.output_tokens
        use = {
            "type": "tool_use",
            "id": reply.tool_calls[0].id,
            "name": "Bash",
            "input": reply.tool_calls[0].arguments,
        }
        history.append({"role": "assistant", "content": [use]})
        if ctx >= checkpoints[0]:
            checkpoints.pop(0)
            inc, inc_wall, base = [], [], []
            for t in range(trials):
                tail = {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": use["id"],
                            "content": _tool_output(10_000 + k * 100 + t, 1000, cpt),
                        }
                    ],
                }
                raw_t = _body([*history, tail])
                w0, c0 = time.perf_counter(), time.thread_time()
                n_inc = _incremental(proxy, ex, raw_t)
                inc.append(time.thread_time() - c0)
                inc_wall.append(time.perf_counter() - w0)
                if t < max(3, trials // 3):
                    c0 = time.thread_time()
                    n_base = _naive(proxy, ex, raw_t)
                    base.append(time.thread_time() - c0)
            rows.append(
                {
                    "context_tokens": n_inc,
                    "p50_ms": round(statistics.median(inc) * 1e3, 3),
                    "wall_p50_ms": round(statistics.median(inc_wall) * 1e3, 3),
                    "baseline_p50_ms": round(statistics.median(base) * 1e3, 3),
                    "baseline_tokens": n_base,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
        history.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use["id"], "content": _tool_output(k, 1000, cpt)}
                ],
            }
        )
        k += 1
    loop.run_until_complete(proxy.aclose())
    loop.close()
    eng.stop()
    return {"rows": rows, "calls": k}


async def _agent(client: httpx.AsyncClient, url: str, cred: str, turns: int) -> int:
    history: list[dict] = [{"role": "user", "content": "go"}]
    for _ in range(turns):
        r = await client.post(
            url + "/v1/messages",
            headers={"x-api-key": cred},
            content=orjson.dumps({"model": "m", "max_tokens": 64, "tools": TOOLS[:2], "messages": history}),
        )
        r.raise_for_status()
        use = r.json()["content"][0]
        history += [
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok " * 50}],
            },
        ]
    return turns


async def _direct(client: httpx.AsyncClient, url: str, ids: list[int], n: int) -> int:
    for _ in range(n):
        r = await client.post(
            url + "/generate",
            content=orjson.dumps(
                {"input_ids": ids, "sampling_params": {"max_new_tokens": 64}, "return_logprob": True}
            ),
        )
        r.raise_for_status()
    return n


def throughput(tok_dir: Path, work: Path, executions: int, turns: int) -> dict:
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok_dir), rules=[ScriptRule(reply=CALL)]))
    url = eng.start()
    srv = ProxyServer(
        ProxyConfig(
            engines=[url], tokenizer=str(tok_dir), store=str(work / "tp"), admin_token="a", fsync=False
        )
    )
    srv.start()
    creds = [srv.register()[1] for _ in range(executions)]

    async def run_proxy() -> float:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=executions)) as c:
            t0 = time.perf_counter()
            await asyncio.gather(*(_agent(c, srv.url, cr, turns) for cr in creds))
            return time.perf_counter() - t0

    async def run_direct() -> float:
        ids = srv.proxy.chat.encode_text("<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n").tolist()
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=executions)) as c:
            t0 = time.perf_counter()
            await asyncio.gather(*(_direct(c, url, ids, turns) for _ in range(executions)))
            return time.perf_counter() - t0

    wall = asyncio.run(run_proxy())
    wall_direct = asyncio.run(run_direct())
    srv.stop()
    eng.stop()
    n = executions * turns
    return {
        "calls": n,
        "calls_per_s": round(n / wall, 1),
        "baseline_engine_direct_calls_per_s": round(n / wall_direct, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="contexts up to 16k, fewer calls")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        tok_dir = build_tiny_tokenizer(work / "tok")
        ov = overhead(tok_dir, work, 16384 if a.quick else 131072, 9 if a.quick else 15)
        tp = throughput(tok_dir, work, 64, 3 if a.quick else 8)
    rows = ov["rows"]
    last = rows[-1]
    out = {
        "bench": "tito_proxy",
        "context_tokens": last["context_tokens"],
        "p50_ms": last["p50_ms"],
        "baseline_p50_ms": last["baseline_p50_ms"],
        "ratio": round(last["baseline_p50_ms"] / max(last["p50_ms"], 1e-9), 1),
        "wall_p50_ms": last["wall_p50_ms"],
        "p50_ms_first_checkpoint": rows[0]["p50_ms"],
        "p50_ms_by_context": {r["context_tokens"]: r["p50_ms"] for r in rows},
        "baseline_p50_ms_by_context": {r["context_tokens"]: r["baseline_p50_ms"] for r in rows},
        **{f"throughput_{k}": v for k, v in tp.items()},
        "concurrent_executions": 64,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
