"""TITO proxy benchmark: per-call proxy CPU vs context length, and calls/s at 64 and 256 concurrent executions.

Part 1 (overhead): one Claude-Code-shaped execution grows by ~1k new tokens per call (a tool result) up to 128k
tokens. At each checkpoint the next call's proxy work (parse the request, restore recorded outputs, render, encode,
match the tree; engine time excluded) is timed on fresh tails, alternating in the same run (ABAB, order swapped every
trial) the candidate (`request_bytes.load_request`: only the bytes after the messages the last body already had are
parsed; `incremental_encode`: only the messages after the part the last request already had are encoded) and the
previous proxy (`incremental_encode=False`, parsed through a message-keyed cache: every message looked up and the whole
conversation rendered and encoded through memoised pieces, as on main before issue 42). A naive proxy (re-render and
re-tokenize everything) is timed on a few trials for reference.

Part 2 (throughput): N executions (64, then 256) run concurrent agent loops over HTTP through a proxy in its own
process (`fsync` on), against a scripted engine in its own process whose replies take `N / --engine-rate` seconds (an
engine serving `--engine-rate` calls/s at that concurrency; a zero-latency engine would measure how fast Python serves
HTTP on this machine's shared cores, not whether the proxy keeps up with an engine). Alternated per round: engine direct
(the same number of calls sent straight to the engine's /generate), the previous proxy (`group_commit=False`: one fsync
per record; `incremental_encode=False`) and the candidate. Reported: calls/s (medians, min-max spread), the proxy
process's CPU ms per call (from /proc), records per fsync.

Times in part 1 are the measuring thread's CPU time (`time.thread_time`), so other processes on a shared machine do not
inflate them; wall-clock p50 is reported alongside, and the 1-minute load average at the start and end. Last line: one
JSON object. `--quick`: contexts up to 16k, fewer calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from gyre_tito import anthropic_api
from gyre_tito.conversation import DEFAULT_VOLATILE_PATTERNS
from gyre_tito.proxy import Proxy, ProxyConfig
from gyre_tito.request_bytes import load_request
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
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


def _with_tail(history: list[dict], use_id: str, seed: int, cpt: float) -> bytes:
    """The next request: the history plus a new ~1k-token tool result."""
    tail = {"type": "tool_result", "tool_use_id": use_id, "content": _tool_output(seed, 1000, cpt)}
    return _body([*history, {"role": "user", "content": [tail]}])


def _naive(proxy: Proxy, ex, raw: bytes) -> int:
    """Baseline: full re-render (harness's copy of every turn) and full re-tokenization, then match."""
    conv, _, _ = anthropic_api.parse_request(orjson.loads(raw), DEFAULT_VOLATILE_PATTERNS)
    text = proxy.chat.render(conv.template_messages(lambda t: None), conv.tools)
    ids = proxy.chat.tokenizer.encode(text, add_special_tokens=False).ids
    ex.records.match(ids)
    return len(ids)


def _proxy_work(proxy: Proxy, ex, raw: bytes, cache, incremental: bool) -> int:
    """One call's proxy work on a request body: parse (through `cache`), restore, render, encode, match."""
    proxy.config.incremental_encode = incremental
    body = load_request(raw, ex.request_history) if incremental else orjson.loads(raw)
    conv, _, _ = anthropic_api.parse_request(body, DEFAULT_VOLATILE_PATTERNS, cache)
    ids, _ = proxy.encode(ex, conv)
    ex.records.match(ids)
    return len(ids)


def _timed(fn, *args) -> tuple[float, float, int]:
    w0, c0 = time.perf_counter(), time.thread_time()
    n = fn(*args)
    return time.thread_time() - c0, time.perf_counter() - w0, n


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


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
    prev_cache: dict = {}  # the previous proxy's parse: every message looked up by its JSON bytes (no prefix)
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
            cand, cand_wall, prev, prev_wall, naive = [], [], [], [], []
            for t in range(trials):
                for incremental in (True, False) if t % 2 == 0 else (False, True):  # ABAB, order swapped
                    # each side gets a tail never seen before (a shared one would be in the encoding cache for
                    # whichever side runs second): new tool output is what every real call brings
                    raw_t = _with_tail(history, use["id"], 10_000 + k * 100 + 2 * t + incremental, cpt)
                    cache = ex.turn_cache if incremental else prev_cache
                    cpu, wall, n = _timed(_proxy_work, proxy, ex, raw_t, cache, incremental)
                    (cand if incremental else prev).append(cpu)
                    (cand_wall if incremental else prev_wall).append(wall)
                    if incremental:
                        n_inc = n
                if t < max(3, trials // 3):
                    cpu, _, n_base = _timed(
                        _naive, proxy, ex, _with_tail(history, use["id"], 90_000 + k * 100 + t, cpt)
                    )
                    naive.append(cpu)
            rows.append(
                {
                    "context_tokens": n_inc,
                    "p50_ms": _ms(cand),
                    "p50_ms_range": [_ms([min(cand)]), _ms([max(cand)])],
                    "wall_p50_ms": _ms(cand_wall),
                    "previous_p50_ms": _ms(prev),
                    "previous_p50_ms_range": [_ms([min(prev)]), _ms([max(prev)])],
                    "previous_wall_p50_ms": _ms(prev_wall),
                    "naive_p50_ms": _ms(naive),
                    "naive_tokens": n_base,
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
    # Not streamed: the engine's replies take the same time either way, and a Python client reading 26 SSE events a
    # call spent more CPU than the engine (on a shared machine it made "direct" slower than through the proxy).
    for _ in range(n):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 64}, "return_logprob": True}
        r = await client.post(url + "/generate", content=orjson.dumps(body))
        r.raise_for_status()
    return n


def _child(kind: str, config: str, fd: int) -> int:
    """`--child engine|proxy CONFIG_JSON FD`: serve the scripted engine or a proxy on an inherited socket."""
    import uvicorn

    if kind == "engine":
        app = ScriptedEngine(ScriptedEngineConfig.model_validate_json(config)).app
    else:
        from gyre_tito.server import create_app

        app = create_app(Proxy(ProxyConfig.model_validate_json(config)))
    uvicorn.run(app, fd=fd, log_level="warning", lifespan="off", timeout_keep_alive=75)
    return 0


class _Served:
    """A child process serving on a socket bound here: requests queue in its backlog until it listens (no polling)."""

    def __init__(self, kind: str, config: str, src: str | None = None) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        argv = [sys.executable, __file__, "--child", kind, config, str(sock.fileno())]
        # `src`: another gyre_tito (e.g. main's) first
        env = os.environ | ({"PYTHONPATH": src} if src else {})
        self.proc = subprocess.Popen(argv, pass_fds=(sock.fileno(),), env=env)
        sock.close()

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _proxy_run(
    tok_dir: Path, store: Path, engine: str, n: int, turns: int, previous: bool, previous_src: str | None
) -> dict:
    cfg = ProxyConfig(
        engines=[engine],
        tokenizer=str(tok_dir),
        store=str(store),
        admin_token="a",
        group_commit=not previous,
        incremental_encode=not previous,
    )
    srv = _Served("proxy", cfg.model_dump_json(), previous_src if previous else None)
    try:
        admin = {"Authorization": "Bearer a"}
        creds = [
            httpx.post(srv.url + "/admin/executions", json={}, headers=admin, timeout=120).json()[
                "credential"
            ]
            for _ in range(n)
        ]
        cpu0 = srv.cpu_s()

        async def run() -> float:
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as c:
                t0 = time.perf_counter()
                await asyncio.gather(*(_agent(c, srv.url, cr, turns) for cr in creds))
                return time.perf_counter() - t0

        wall = asyncio.run(run())
        cpu = srv.cpu_s() - cpu0
        metrics = httpx.get(srv.url + "/metrics", headers=admin, timeout=60).text
        found = [
            int(x.split()[1]) for x in metrics.splitlines() if x.startswith("gyre_tito_record_fsyncs_total")
        ]
        fsyncs = found[0] if found else n * turns  # a proxy without the counter syncs every record
    finally:
        srv.stop()
    calls = n * turns
    return {
        "calls_per_s": calls / wall,
        "cpu_ms_per_call": cpu * 1e3 / calls,
        "records_per_fsync": calls / max(fsyncs, 1),
    }


def throughput(
    tok_dir: Path, work: Path, n: int, turns: int, rounds: int, engine_rate: float, previous_src: str | None
) -> dict:
    """Engine direct, previous proxy and candidate, alternated `rounds` times (order reversed every other round)."""
    reply_tokens = len(build_chat(tok_dir).encode_text(CALL)) + 1
    delay = n / engine_rate / reply_tokens  # per token: a reply takes n / engine_rate seconds
    eng = _Served(
        "engine",
        ScriptedEngineConfig(
            tokenizer=str(tok_dir), rules=[ScriptRule(reply=CALL)], token_delay_s=delay
        ).model_dump_json(),
    )
    ids = build_chat(tok_dir).encode_text("<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n").tolist()

    async def direct() -> float:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as c:
            t0 = time.perf_counter()
            await asyncio.gather(*(_direct(c, eng.url, ids, turns) for _ in range(n)))
            return time.perf_counter() - t0

    runs: dict[str, list[dict]] = {"direct": [], "previous": [], "candidate": []}
    try:
        for r in range(rounds):
            order = ["direct", "previous", "candidate"]
            for mode in order if r % 2 == 0 else order[::-1]:
                if mode == "direct":
                    runs[mode].append({"calls_per_s": n * turns / asyncio.run(direct())})
                else:
                    store = work / f"tp-{n}-{r}-{mode}"
                    previous = mode == "previous"
                    runs[mode].append(_proxy_run(tok_dir, store, eng.url, n, turns, previous, previous_src))
                print(
                    json.dumps({"executions": n, "round": r, "mode": mode, **runs[mode][-1]}), file=sys.stderr
                )
    finally:
        eng.stop()

    def med(mode: str, key: str) -> float:
        return round(statistics.median(x[key] for x in runs[mode]), 2)

    def spread(mode: str, key: str) -> list[float]:
        return [round(min(x[key] for x in runs[mode]), 2), round(max(x[key] for x in runs[mode]), 2)]

    direct_rate = med("direct", "calls_per_s")
    return {
        "executions": n,
        "calls_per_run": n * turns,
        "engine_reply_s": round(n / engine_rate, 3),
        "engine_direct_calls_per_s": direct_rate,
        "engine_direct_range": spread("direct", "calls_per_s"),
        **{
            f"{m}_{k}": v
            for m in ("previous", "candidate")
            for k, v in (
                ("calls_per_s", med(m, "calls_per_s")),
                ("calls_per_s_range", spread(m, "calls_per_s")),
                ("vs_direct", round(med(m, "calls_per_s") / direct_rate, 3)),
                ("cpu_ms_per_call", med(m, "cpu_ms_per_call")),
                ("cpu_ms_per_call_range", spread(m, "cpu_ms_per_call")),
                ("records_per_fsync", med(m, "records_per_fsync")),
            )
        },
    }


def build_chat(tok_dir: Path):
    from gyre_tito.render import ChatTokenizer

    return ChatTokenizer(tok_dir)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        return _child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="contexts up to 16k, fewer calls")
    ap.add_argument("--engine-rate", type=float, default=50.0, help="calls/s the scripted engine serves")
    ap.add_argument("--rounds", type=int, default=None, help="ABAB rounds of the throughput part")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument(
        "--previous-src",
        default=None,
        help="a gyre_tito source tree (e.g. `git archive <commit> packages/gyre-tito/src`) whose proxy is the "
        "throughput baseline (default: this one with group_commit and incremental_encode off)",
    )
    a = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        tok_dir = build_tiny_tokenizer(work / "tok")
        rows = (
            []
            if a.skip_overhead
            else overhead(tok_dir, work, 16384 if a.quick else 131072, 9 if a.quick else 15)["rows"]
        )
        rounds = a.rounds or (2 if a.quick else 3)
        tp = [
            throughput(tok_dir, work, n, turns, rounds, a.engine_rate, a.previous_src)
            for n, turns in ((64, 3 if a.quick else 6), (256, 2 if a.quick else 3))
        ]
    out: dict = {"bench": "tito_proxy", "load_average_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    if rows:
        first, last = rows[0], rows[-1]
        out |= {
            "context_tokens": last["context_tokens"],
            "p50_ms": last["p50_ms"],
            "previous_p50_ms": last["previous_p50_ms"],
            "naive_p50_ms": last["naive_p50_ms"],
            "wall_p50_ms": last["wall_p50_ms"],
            "p50_ms_first_checkpoint": first["p50_ms"],
            "growth_first_to_last": round(last["p50_ms"] / max(first["p50_ms"], 1e-9), 2),
            "previous_growth_first_to_last": round(
                last["previous_p50_ms"] / max(first["previous_p50_ms"], 1e-9), 2
            ),
            "p50_ms_by_context": {r["context_tokens"]: r["p50_ms"] for r in rows},
            "p50_ms_range_by_context": {r["context_tokens"]: r["p50_ms_range"] for r in rows},
            "previous_p50_ms_by_context": {r["context_tokens"]: r["previous_p50_ms"] for r in rows},
            "previous_p50_ms_range_by_context": {
                r["context_tokens"]: r["previous_p50_ms_range"] for r in rows
            },
            "naive_p50_ms_by_context": {r["context_tokens"]: r["naive_p50_ms"] for r in rows},
        }
    out["throughput"] = tp
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
