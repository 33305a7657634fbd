"""Torch engine throughput: concurrent requests (continuous batching) vs the same requests sent one by one,
plus release -> resume -> first-token latency. Real HTTP on loopback, tiny Qwen3 model built offline.

    uv run python bench/engine_throughput.py [--quick]

Last line: one JSON object. Baseline = sequential requests measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import threading
import time

import httpx
import uvicorn

from gyre_cell.engine import EngineConfig, TorchEngine
from gyre_cell.engine.server import create_app
from gyre_cell.tiny_model import build_tiny_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _body(i: int, max_new: int) -> dict:
    prompt = [(7 * i + j) % 500 + 1 for j in range(24)]  # distinct prompts: no prefix-cache shortcut
    return {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True},
    }


async def _one(http: httpx.AsyncClient, i: int, max_new: int) -> int:
    r = await http.post("/generate", json=_body(i, max_new))
    r.raise_for_status()
    return len(r.json()["output_ids"])


async def _sequential(http: httpx.AsyncClient, n: int, max_new: int) -> float:
    t0 = time.perf_counter()
    toks = 0
    for i in range(n):
        toks += await _one(http, i, max_new)
    return toks / (time.perf_counter() - t0)


async def _concurrent(http: httpx.AsyncClient, n: int, max_new: int) -> float:
    t0 = time.perf_counter()
    toks = sum(await asyncio.gather(*(_one(http, 1000 + i, max_new) for i in range(n))))
    return toks / (time.perf_counter() - t0)


async def _release_resume(http: httpx.AsyncClient) -> dict[str, float]:
    t0 = time.perf_counter()
    (await http.post("/release_memory_occupation", json={})).raise_for_status()
    t1 = time.perf_counter()
    (await http.post("/resume_memory_occupation", json={})).raise_for_status()
    t2 = time.perf_counter()
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    (await http.post("/generate", json=body)).raise_for_status()
    t3 = time.perf_counter()
    return {
        "release_ms": (t1 - t0) * 1e3,
        "resume_ms": (t2 - t1) * 1e3,
        "first_token_ms": (t3 - t2) * 1e3,
        "release_to_first_token_ms": (t3 - t0) * 1e3,
    }


async def _run(url: str, quick: bool) -> dict:
    max_new = 32 if quick else 64
    n_seq = 8 if quick else 16
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await _one(http, 0, 4)  # warm-up
        seq = await _sequential(http, n_seq, max_new)
        conc = {k: await _concurrent(http, k, max_new) for k in (1, 8, 32)}
        rr = [await _release_resume(http) for _ in range(3)]
    best = min(rr, key=lambda x: x["release_to_first_token_ms"])
    return {
        "bench": "engine_throughput",
        "max_new_tokens": max_new,
        "baseline_sequential_tok_s": round(seq, 1),
        "concurrent_1_tok_s": round(conc[1], 1),
        "concurrent_8_tok_s": round(conc[8], 1),
        "concurrent_32_tok_s": round(conc[32], 1),
        "ratio_8": round(conc[8] / seq, 2),
        "ratio_32": round(conc[32] / seq, 2),
        **{k: round(v, 2) for k, v in best.items()},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        cfg = EngineConfig(model_path=str(build_tiny_model(d)))
        print(json.dumps({"config": cfg.model_dump(), "quick": args.quick}), flush=True)
        engine = TorchEngine(cfg)
        port = _free_port()
        server = uvicorn.Server(
            uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        try:
            result = asyncio.run(_run(f"http://127.0.0.1:{port}", args.quick))
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
