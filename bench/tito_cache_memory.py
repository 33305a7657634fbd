"""What the TITO proxy keeps after its executions end (issue 37): RSS of a proxy process before and after N unique
~120 KB executions (register, one call, end), for a baseline revision of gyre-tito against the working tree.

Each trial is a fresh proxy process (the code under test on its PYTHONPATH: the baseline's gyre_tito unpacked from
`git archive`, or the working tree's); the scripted engine runs in this driver process, so only the proxy's memory is
measured. Trials alternate baseline, candidate, baseline, candidate...; medians are reported. The last line printed
is one JSON object.

    uv run python bench/tito_cache_memory.py --baseline 30b9961~1          # 150 executions, 3 rounds
    uv run python bench/tito_cache_memory.py --baseline 30b9961~1 --quick  # 30 executions, 1 round

Measured here (2 cores at load 13-18; MB kept after the executions ended / MB the encoding caches count), baseline
30b9961~1 against 81a4de4: 30 executions 49.2 / 27.4 -> 28.0 / 20.2; 60 executions, 2 rounds (medians)
86.7 / 53.9 -> 41.0 / 39.8; 150 executions, 1 round 173.8 / 127.4 (both caches at their 64 MiB) -> 122.5 / 98.6.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import gc, json, sys
from gyre_tito.proxy import ProxyConfig
from gyre_tito.testing import ProxyServer

def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

engine, tok, store = sys.argv[1:4]
cfg = ProxyConfig(engines=[engine], tokenizer=tok, store=store, admin_token="adm")
with ProxyServer(cfg) as srv:
    print(json.dumps({"url": srv.url}), flush=True)
    for line in sys.stdin:
        gc.collect()
        pool = srv.proxy.pool
        counted = srv.proxy.chat.cache_bytes()
        contexts = pool.context_bytes() if hasattr(pool, "context_bytes") else None
        print(json.dumps({"rss_kb": rss_kb(), "cache_bytes": counted, "context_bytes": contexts,
                          "loaded": len(srv.proxy.executions)}), flush=True)
"""


def _unpack(rev: str, into: Path) -> Path:
    """gyre_tito of `rev`, read from git without touching the working tree."""
    data = subprocess.run(
        ["git", "archive", rev, "packages/gyre-tito/src"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / "packages" / "gyre-tito" / "src"


def _execution(url: str, admin: dict, e: int, trial: str) -> None:
    r = httpx.post(
        url + "/admin/executions", json={"execution_id": f"{trial}-{e}"}, headers=admin, timeout=120
    )
    r.raise_for_status()
    cred = r.json()["credential"]
    text = f"{trial} {e} " + "lorem ipsum dolor sit amet " * 4500  # ~120 KB, unique to the execution
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": cred}, timeout=300)
    r.raise_for_status()
    httpx.post(url + f"/admin/executions/{trial}-{e}/end", headers=admin, timeout=120).raise_for_status()


def trial(src: Path, engine: str, tok: str, n: int, name: str) -> dict:
    with tempfile.TemporaryDirectory() as store:
        env = dict(os.environ, PYTHONPATH=str(src))
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, engine, tok, store],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            url = json.loads(child.stdout.readline())["url"]
            admin = {"authorization": "Bearer adm"}

            def measure() -> dict:
                child.stdin.write("m\n")
                child.stdin.flush()
                return json.loads(child.stdout.readline())

            _execution(url, admin, -1, name)  # warm-up: imports, first encode, first connection
            before = measure()
            t0 = time.perf_counter()
            for e in range(n):
                _execution(url, admin, e, name)
            after = measure()
            return {
                "kept_mb": (after["rss_kb"] - before["rss_kb"]) / 1024,
                "counted_mb": after["cache_bytes"] / 2**20,
                "contexts_bytes": after["context_bytes"],
                "loaded": after["loaded"],
                "seconds": time.perf_counter() - t0,
            }
        finally:
            child.stdin.close()
            child.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="git revision of the baseline gyre-tito")
    ap.add_argument("--executions", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="30 executions, one round")
    a = ap.parse_args()
    n, rounds = (30, 1) if a.quick else (a.executions, a.rounds)

    from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig
    from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        base_src = _unpack(a.baseline, Path(tmp) / "baseline")
        cand_src = ROOT / "packages" / "gyre-tito" / "src"
        tok = str(build_tiny_tokenizer(Path(tmp) / "tok"))
        engine = ScriptedEngine(ScriptedEngineConfig(tokenizer=tok, default_reply="ok " * 3))
        url = engine.start()
        results: dict[str, list[dict]] = {"baseline": [], "candidate": []}
        try:
            for r in range(rounds):
                for name, src in (("baseline", base_src), ("candidate", cand_src)):
                    res = trial(src, url, tok, n, f"{name[0]}{r}")
                    results[name].append(res)
                    print(name, r, json.dumps(res), flush=True)
        finally:
            engine.stop()

    def med(name: str, key: str) -> float:
        return round(statistics.median(x[key] for x in results[name]), 1)

    summary = {
        "bench": "tito_cache_memory",
        "executions": n,
        "rounds": rounds,
        "baseline": a.baseline,
        "baseline_kept_mb": med("baseline", "kept_mb"),
        "candidate_kept_mb": med("candidate", "kept_mb"),
        "baseline_counted_mb": med("baseline", "counted_mb"),
        "candidate_counted_mb": med("candidate", "counted_mb"),
        "baseline_s": med("baseline", "seconds"),
        "candidate_s": med("candidate", "seconds"),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
