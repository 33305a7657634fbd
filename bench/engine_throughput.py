"""Torch engine throughput: concurrent requests (continuous batching) vs the same requests sent one by one,
plus release -> resume -> first-token latency. The engine runs as `gyre-cell engine serve` in its own
process (as in production: clients never share its GIL); real HTTP on loopback; tiny Qwen3 built offline.
Each figure is the best of `--repeats` runs (the CI machines are shared and noisy).

    uv run python bench/engine_throughput.py [--quick]
    uv run python bench/engine_throughput.py --vllm [--quick]

`--vllm`: Gyre's engine (baseline) against vLLM (`gyre_cell.vllm_env`'s environment) on the same model (head_dim
32, which vLLM's CPU attention needs), both called through gyre-tito's engine pool as the proxy calls them, 1 and 8
concurrent requests, alternated A B A B; medians, spread and the vLLM/Gyre ratio.

Last line: one JSON object. Baseline = sequential requests measured in the same run (`--vllm`: Gyre's engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

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


async def _run(url: str, quick: bool, repeats: int) -> dict:
    max_new = 32 if quick else 64
    n_seq = 8
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await _one(http, 0, 4)  # warm-up
        seq = max([await _sequential(http, n_seq, max_new) for _ in range(repeats)])
        conc = {k: max([await _concurrent(http, k, max_new) for _ in range(repeats)]) for k in (1, 8, 32)}
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


async def _pool_rate(pool, n: int, max_new: int, offset: int) -> float:
    """Tokens a second for `n` concurrent calls through gyre-tito's engine pool."""
    sp = {"max_new_tokens": max_new, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    t0 = time.perf_counter()
    calls = [pool.generate(_body(offset + i, max_new)["input_ids"], sp) for i in range(n)]
    toks = sum(len(r.output_ids) for r in await asyncio.gather(*calls))
    return toks / (time.perf_counter() - t0)


async def _compare(urls: dict[str, tuple[str, str | None]], quick: bool, repeats: int) -> dict:
    from gyre_tito.engine_client import EnginePool, EnginePoolConfig

    max_new = 64 if quick else 128
    pools = {
        name: EnginePool(EnginePoolConfig(engines=[url], api=name), api_key=key)
        for name, (url, key) in urls.items()
    }
    rates: dict[tuple[str, int], list[float]] = {(e, n): [] for e in pools for n in (1, 8)}
    try:
        for pool in pools.values():  # warm-up
            await _pool_rate(pool, 2, 4, 0)
        for r in range(repeats):  # A B A B: each engine measured between the other's runs
            for n in (1, 8):
                for e, pool in pools.items():
                    rates[e, n].append(await _pool_rate(pool, n, max_new, 100 * r + 10 * n))
    finally:
        for pool in pools.values():
            await pool.aclose()
    out: dict = {"bench": "engine_throughput_vllm", "max_new_tokens": max_new, "repeats": repeats}
    for (e, n), xs in rates.items():
        out[f"{e}_{n}_tok_s"] = {
            "median": round(statistics.median(xs), 1),
            "min": round(min(xs), 1),
            "max": round(max(xs), 1),
        }
    for n in (1, 8):
        out[f"ratio_vllm_over_gyre_{n}"] = round(
            statistics.median(rates["vllm", n]) / statistics.median(rates["sglang", n]), 2
        )
    return out


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("engine server did not start")
        time.sleep(0.3)


def _vllm_main(quick: bool, repeats: int, cpu_threads: int, vllm_args: list[str]) -> dict:
    from gyre_cell.tiny_model import TinyModelConfig
    from gyre_cell.vllm_adapter import VLLMServer
    from gyre_cell.vllm_env import ensure_vllm_env
    from gyre_cell.vllm_launch import VLLMLaunchConfig

    python = ensure_vllm_env(log=lambda line: print(line, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory() as d:
        model = build_tiny_model(d, TinyModelConfig(head_dim=32))
        port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "gyre_cell.cli",
            "engine",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--cpu-threads",
            str(cpu_threads),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        vllm = VLLMServer(
            VLLMLaunchConfig(
                model_path=str(model),
                python=str(python),
                port=_free_port(),
                dtype="float32",
                max_model_len=4096,
                extra_args=tuple(vllm_args),
            )
        )
        t0 = time.monotonic()
        vllm.start(log_path=str(Path(d) / "vllm.log"))
        try:
            asyncio.run(vllm.wait_ready(timeout_s=900))
            vllm_start_s = time.monotonic() - t0
            torch_url = f"http://127.0.0.1:{port}"
            _wait_healthy(torch_url, proc, 180)
            print(json.dumps({"quick": quick, "repeats": repeats, "vllm_start_s": round(vllm_start_s, 1)}))
            result = asyncio.run(
                _compare({"sglang": (torch_url, None), "vllm": (vllm.base_url, None)}, quick, repeats)
            )
            result["vllm_start_s"] = round(vllm_start_s, 1)
        finally:
            vllm.stop()
            proc.terminate()
            proc.wait(timeout=30)
    result["baseline"] = "gyre torch engine (api sglang)"
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="shorter requests, fewer repeats")
    ap.add_argument("--repeats", type=int, default=None, help="runs per figure (default 2 quick, 3 full)")
    ap.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="engine's torch intra-op threads (1: best for the tiny model)",
    )
    ap.add_argument("--vllm", action="store_true", help="Gyre's engine against vLLM on the same model")
    ap.add_argument("--vllm-arg", action="append", default=[], help="a flag for the vLLM server (repeatable)")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    if args.vllm:
        result = _vllm_main(args.quick, max(repeats, 3), args.cpu_threads, args.vllm_arg)
        print(json.dumps(result | {"vllm_args": args.vllm_arg}))
        return
    with tempfile.TemporaryDirectory() as d:
        model = build_tiny_model(d)
        port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "gyre_cell.cli",
            "engine",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--cpu-threads",
            str(args.cpu_threads),
        ]
        print(json.dumps({"quick": args.quick, "repeats": repeats, "server": cmd[1:]}), flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, 180)
            result = asyncio.run(_run(url, args.quick, repeats))
            result["cpu_threads"] = args.cpu_threads
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
