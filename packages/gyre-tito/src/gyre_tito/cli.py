"""`gyre-tito` command line.

- `gyre-tito serve --engine URL [--engine URL ...] --tokenizer PATH --store DIR --port N [--admin-token-file F]`: run
  the proxy; writes its resolved config to `DIR/config.json` first. Tokens (admin, engines) come from a mode-600 file or
  an inherited fd, never from the environment or argv (the deprecated `--admin-token` / `GYRE_TITO_ADMIN_TOKEN` still
  work, with a warning); none is written to config.json. Admin export writes only under
  the store or a `--export-dir DIR` (repeatable).
- `gyre-tito tiny-tokenizer DIR`: write the tiny offline Qwen3-style tokenizer (tests, demos).
- `gyre-tito scripted-engine --tokenizer DIR --script FILE --port N`: serve a scripted `/generate` engine.
- `gyre-tito export SOURCE --out PATH [--format parquet|dataset] [--rewards DB] [--per-step]`: selected trajectories
  of a run or store with their rewards joined, optionally one file per optimizer step (`gyre_tito.dataset_export`).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

__all__ = ["main"]


def _serve(a: argparse.Namespace) -> int:
    import uvicorn

    from gyre_sched.secret import read_secret
    from gyre_tito.engine_client import EnginePoolConfig
    from gyre_tito.proxy import Proxy, ProxyConfig
    from gyre_tito.server import create_app

    if not (Path(a.tokenizer) / "tokenizer.json").is_file():
        print(f"gyre-tito serve: --tokenizer {a.tokenizer}: no tokenizer.json there", file=sys.stderr)
        return 2
    for url in a.engine:
        if not url.startswith(("http://", "https://")):
            print(f"gyre-tito serve: --engine {url!r}: must be an http(s) URL", file=sys.stderr)
            return 2
    try:
        admin_token = read_secret(a.admin_token_file, a.admin_token_fd)
        engine_key = read_secret(a.engine_api_key_file, a.engine_api_key_fd)
    except ValueError as e:  # SecretError: its message names the source
        print(f"gyre-tito serve: {e}", file=sys.stderr)
        return 2
    try:  # held by whoever started the proxy: no other process can take the port before it listens
        sockets = None if a.listen_fd is None else [socket.socket(fileno=a.listen_fd)]
    except OSError as e:
        print(f"gyre-tito serve: --listen-fd {a.listen_fd}: {e.strerror or e}", file=sys.stderr)
        return 2
    legacy = a.admin_token or os.environ.get("GYRE_TITO_ADMIN_TOKEN")
    if admin_token is None and legacy:
        print(
            "gyre-tito serve: warning: --admin-token / GYRE_TITO_ADMIN_TOKEN put the token where every process of "
            "this user can read it (/proc/PID/cmdline, /proc/PID/environ); use --admin-token-file or --admin-token-fd",
            file=sys.stderr,
        )
        admin_token = legacy
    cfg = ProxyConfig(
        engines=a.engine,
        engine=EnginePoolConfig(api=a.engine_api),
        tokenizer=str(Path(a.tokenizer).resolve()),
        store=str(Path(a.store).resolve()),
        model_name=a.model_name,
        admin_token=admin_token,
        engine_api_key=engine_key,
        context_from_engines=not a.no_engine_context,
        max_request_bytes=a.max_request_bytes,
        max_context_tokens=a.max_context,
        fsync=not a.no_fsync,
        group_commit=not a.no_group_commit,
        export_dirs=[str(Path(d).resolve()) for d in a.export_dir],
        context_overflow=a.context_overflow,
        sampling_policy=a.sampling_policy,
        temperature=a.temperature,
    )
    Path(cfg.store).mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(exclude={"admin_token", "engine_api_key"}) | {"host": a.host, "port": a.port}
    import json

    (Path(cfg.store) / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    try:
        proxy = Proxy(cfg)
    except ValueError as e:  # e.g. an --export-dir overlapping the store
        print(f"gyre-tito serve: {e}", file=sys.stderr)
        return 2
    # harnesses keep connections open between calls that can be minutes apart (tool runs): long keep-alive
    config = uvicorn.Config(
        create_app(proxy), host=a.host, port=a.port, log_level=a.log_level, timeout_keep_alive=75
    )
    server = uvicorn.Server(config)
    server.run(sockets=sockets)
    return 0 if server.started else 3  # uvicorn's own status for a server that never started


def _tiny(a: argparse.Namespace) -> int:
    from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

    print(build_tiny_tokenizer(a.dir))
    return 0


def _scripted(a: argparse.Namespace) -> int:
    from gyre_tito import scripted_engine

    argv = ["--tokenizer", a.tokenizer, "--port", str(a.port), "--token-delay", str(a.token_delay)]
    if a.script:
        argv += ["--script", a.script]
    return scripted_engine.main(argv)


def _export(a: argparse.Namespace) -> int:
    import json

    from gyre_tito.dataset_export import export_dataset

    try:
        summary = export_dataset(
            a.source,
            a.out,
            fmt=a.format,
            rewards=a.rewards,
            executions=a.execution or None,
            j_max=a.j_max,
            seed=a.seed,
            include_unrewarded=a.include_unrewarded,
            per_step=a.per_step,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"gyre-tito export: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


ENGINE_APIS = ["sglang", "vllm"]
"""`gyre_tito.engine_client.EngineAPI`'s values, spelled here so that parsing imports nothing (a test checks)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="gyre-tito", description="Token-in-token-out proxy for agent harnesses."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the proxy (Anthropic + OpenAI APIs over /generate engines)")
    s.add_argument("--engine", action="append", default=[], help="engine base URL (repeatable)")
    s.add_argument(
        "--engine-api",
        choices=ENGINE_APIS,
        default="sglang",
        help="the engines' token-in/token-out route: sglang (SGLang's /generate: SGLang, Gyre's engine) or vllm "
        "(vLLM's /inference/v1/generate; start vLLM with --enable-scale-out)",
    )
    s.add_argument("--tokenizer", required=True, help="tokenizer directory (tokenizer.json + chat template)")
    s.add_argument("--store", required=True, help="directory for records, executions and config.json")
    s.add_argument("--port", type=int, default=8787)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument(
        "--listen-fd", type=int, help="serve on this inherited bound socket (a launcher's), not --port"
    )
    s.add_argument("--model-name", default="gyre-policy", help="model name reported to harnesses")
    s.add_argument("--admin-token-file", default=None, help="file (mode 600) holding the admin API token")
    s.add_argument(
        "--admin-token-fd", type=int, default=None, help="read the admin token from this inherited fd"
    )
    s.add_argument(
        "--admin-token",
        default=None,
        help="deprecated (visible to every local process): use --admin-token-file",
    )
    s.add_argument(
        "--engine-api-key-file", default=None, help="file (mode 600): bearer token sent to engines"
    )
    s.add_argument("--engine-api-key-fd", type=int, default=None, help="read the engines' token from this fd")
    s.add_argument(
        "--no-engine-context", action="store_true", help="keep --max-context even if engines report less"
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body (default: from --max-context)",
    )
    s.add_argument("--max-context", type=int, default=131072, help="model context limit in tokens")
    s.add_argument(
        "--export-dir", action="append", default=[], help="admin export may also write under DIR (repeatable)"
    )
    s.add_argument(
        "--context-overflow",
        choices=["clamp", "refuse"],
        default="clamp",
        help="max_tokens beyond the room left in the context: clamp it, or refuse in Anthropic's wording",
    )
    s.add_argument(
        "--sampling-policy",
        choices=["pin", "refuse", "pass"],
        default="pin",
        help="per-call temperature/top_p/top_k: pin to the run's (top_p=1, top_k=-1), refuse others, or pass",
    )
    s.add_argument("--temperature", type=float, default=1.0, help="the run's sampling temperature")
    s.add_argument("--no-fsync", action="store_true", help="skip fsync per record (benchmarks only)")
    s.add_argument(
        "--no-group-commit",
        action="store_true",
        help="one fsync per record in its own log instead of one shared by the calls that complete together",
    )
    s.add_argument("--log-level", default="warning")
    s.set_defaults(fn=_serve)
    t = sub.add_parser("tiny-tokenizer", help="write the tiny offline Qwen3-style tokenizer to DIR")
    t.add_argument("dir")
    t.set_defaults(fn=_tiny)
    e = sub.add_parser("scripted-engine", help="serve a scripted /generate engine (tests)")
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--script", default=None)
    e.add_argument("--port", type=int, default=0)
    e.add_argument("--token-delay", type=float, default=0.0)
    e.set_defaults(fn=_scripted)
    x = sub.add_parser(
        "export", help="selected trajectories of a run or store, rewards joined (Parquet / dataset)"
    )
    x.add_argument("source", help="run directory, proxy store, or folder of record logs")
    x.add_argument("--out", required=True, help="output file (parquet) or folder (dataset)")
    x.add_argument("--format", choices=["parquet", "dataset"], default="parquet")
    x.add_argument(
        "--rewards", default=None, help="gyre-eval's assessments.sqlite (default: SOURCE's, if any)"
    )
    x.add_argument("--execution", action="append", default=[], help="only this execution (repeatable)")
    x.add_argument("--j-max", type=int, default=5)
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--include-unrewarded", action="store_true", help="also executions without a final reward")
    x.add_argument(
        "--per-step",
        action="store_true",
        help="a run's rows in one file per optimizer step (step-NNNNN.parquet)",
    )
    x.set_defaults(fn=_export)
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    raise SystemExit(main())
