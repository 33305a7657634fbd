"""KV-cache migration on reroute vs recompute: time from the reroute to the next token at the destination.

A request with C tokens of context moves from engine S to engine D (paper §4.3, issue 17).
- recompute: D prefills the whole context (in `--chunk`-token prefills through the prefix cache, as a chunked-prefill
  engine would; one C-token attention matrix does not fit this machine at 32k) and samples the next token.
- migration: S pins the blocks holding the context (`KVMigrator.pin`), D reads them over Mooncake (TCP on loopback),
  checks and installs them, acknowledges (S releases), then samples the next token computing only the last one.
The recompute run is also what gives S its KV: D of one measurement is S of the next (one prefill per context).
Both engines live in this process (Python API, no HTTP); the Mooncake read still crosses a TCP socket.
The next token and its log-prob must agree between both paths (checked, reported as max_logprob_diff).

    uv run python bench/kv_migration.py [--quick] [--contexts 2048,8192,32768] [--wide-contexts 2048,8192]

Models: the tiny Qwen3 (hidden 64, 2 layers, 2 KV heads) and a wider one (hidden 256, 4 layers, 8 KV heads of 32,
intermediate 1024) whose prefill is costly on CPU. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gyre_cell.engine import EngineConfig, SamplingSpec, TorchEngine
from gyre_cell.tiny_model import TinyModelConfig, build_tiny_model

GREEDY = SamplingSpec(max_new_tokens=1, temperature=0.0, ignore_eos=True)


def generate(engine: TorchEngine, ids: list[int], rid: str) -> tuple[int, float, int]:
    """(token, log-prob, cached tokens) of one greedy token after `ids`."""
    done = threading.Event()
    out: dict[str, Any] = {}

    def sink(resp: dict[str, Any], finished: bool) -> None:
        if finished:
            out.update(resp)
            done.set()

    engine.submit(rid=rid, input_ids=ids, sampling=GREEDY, return_logprob=True, stream=False, sink=sink)
    done.wait()
    meta = out["meta_info"]
    if meta["finish_reason"]["type"] == "abort":
        raise RuntimeError(f"generation aborted: {meta['finish_reason']}")
    lp, tok, _ = meta["output_token_logprobs"][0]
    return tok, lp, meta["cached_tokens"]


def chunked_prefill(engine: TorchEngine, ids: list[int], chunk: int, tag: str) -> tuple[int, float]:
    for end in range(chunk, len(ids), chunk):
        generate(engine, ids[:end], f"{tag}-{end}")
    tok, lp, _ = generate(engine, ids, f"{tag}-final")
    return tok, lp


def measure(
    model: Path, name: str, contexts: list[int], chunk: int, threads: int | None
) -> list[dict[str, Any]]:
    cap = max(contexts) + 2 * chunk
    cfg = EngineConfig(
        model_path=str(model), device="cpu", max_total_tokens=cap, max_prefill_tokens=cap, cpu_threads=threads
    )
    engines = [TorchEngine(cfg), TorchEngine(cfg)]
    rows = []
    try:
        for i, ctx in enumerate(contexts):
            g = torch.Generator().manual_seed(ctx)
            ids = torch.randint(5, 500, (ctx + 1,), generator=g).tolist()  # context + the token being decoded
            dst_rec, dst_mig = engines[i % 2], engines[(i + 1) % 2]
            for e in engines:
                e.flush_cache()
            # recompute: the destination prefills everything (this also gives it the KV it then serves as a source)
            t0 = time.perf_counter()
            tok_rec, lp_rec = chunked_prefill(dst_rec, ids, chunk, f"{name}-{ctx}-rec")
            recompute_s = time.perf_counter() - t0
            src = dst_rec
            # migration: pin at the source, take over at the destination (read, check, install, ack), next token
            used_before = dst_mig.load()["num_used_tokens"]
            t0 = time.perf_counter()
            export = src.migrator.pin(token_ids=ids, ttl_s=60)
            t_pin = time.perf_counter()
            res = dst_mig.migrator.takeover(
                export, token_ids=ids, ack=lambda e, s=src: s.migrator.ack(e.migration_id) > 0
            )
            t_take = time.perf_counter()
            if res.status != "installed":
                raise RuntimeError(f"takeover {res.status}: {res.reason}")
            ctx_prefill0 = dst_mig.context_prefill_tokens_total
            tok_mig, lp_mig, cached = generate(dst_mig, ids, f"{name}-{ctx}-mig")
            migration_s = time.perf_counter() - t0
            if tok_mig != tok_rec:
                raise RuntimeError(f"next token differs: migration {tok_mig} vs recompute {tok_rec}")
            row = {
                "model": name,
                "context": ctx,
                "recompute_s": round(recompute_s, 4),
                "migration_s": round(migration_s, 4),
                "ratio": round(recompute_s / migration_s, 2),
                "pin_s": round(t_pin - t0, 4),
                "takeover_s": round(t_take - t_pin, 4),
                "read_s": round(res.read_s, 4),
                "bytes": res.nbytes,
                "read_gib_s": round(res.nbytes / max(res.read_s, 1e-9) / 2**30, 3),
                "migrated_tokens": res.migrated_tokens,
                "cached_tokens": cached,
                "recomputed_context_tokens": dst_mig.context_prefill_tokens_total - ctx_prefill0,
                "max_logprob_diff": abs(lp_mig - lp_rec),
                "source_pins_left": len(src.migrator.pins),
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            for e in engines:
                e.flush_cache()
            assert dst_mig.load()["num_used_tokens"] == used_before
    finally:
        for e in engines:
            e.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2k and 8k, tiny model only")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--wide-contexts", default="2048,8192", help="the wide model's contexts ('' to skip)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk of the recompute path")
    ap.add_argument("--cpu-threads", type=int, default=None)
    args = ap.parse_args()
    contexts = [2048, 8192] if args.quick else [int(x) for x in args.contexts.split(",") if x]
    wide_contexts = [] if args.quick else [int(x) for x in args.wide_contexts.split(",") if x]
    if not contexts and not wide_contexts:
        ap.error("nothing to measure")
    max_pos = max(contexts + wide_contexts) + 4 * args.chunk
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", TinyModelConfig(max_position_embeddings=max_pos))
        if contexts:
            rows += measure(tiny, "tiny", contexts, args.chunk, args.cpu_threads)
        if wide_contexts:
            wide_cfg = TinyModelConfig(
                hidden_size=256,
                intermediate_size=1024,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=8,
                head_dim=32,
                max_position_embeddings=max_pos,
            )
            wide = build_tiny_model(Path(tmp) / "wide", wide_cfg)
            rows += measure(wide, "wide", wide_contexts, args.chunk, args.cpu_threads)
    summary: dict[str, Any] = {}
    for r in rows:
        key = f"{r['model']}_{r['context'] // 1024}k"
        summary[f"{key}_recompute_s"] = r["recompute_s"]
        summary[f"{key}_migration_s"] = r["migration_s"]
        summary[f"{key}_ratio"] = r["ratio"]
        summary[f"{key}_bytes"] = r["bytes"]
    summary["recomputed_context_tokens_max"] = max(r["recomputed_context_tokens"] for r in rows)
    summary["max_logprob_diff"] = max(r["max_logprob_diff"] for r in rows)
    summary["read_gib_s_max"] = max(r["read_gib_s"] for r in rows)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
