"""`gyre-tito` command line.

- `gyre-tito serve --engine URL [--engine URL ...] --tokenizer PATH --store DIR --port N [--admin-token T]`: run the
  proxy; writes its resolved config to `DIR/config.json` first. The admin token comes from `--admin-token` or the
  `GYRE_TITO_ADMIN_TOKEN` environment variable (it is not written to config.json). Admin export writes only under
  the store or a `--export-dir DIR` (repeatable).
- `gyre-tito tiny-tokenizer DIR`: write the tiny offline Qwen3-style tokenizer (tests, demos).
- `gyre-tito scripted-engine --tokenizer DIR --script FILE --port N`: serve a scripted `/generate` engine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["main"]


def _serve(a: argparse.Namespace) -> int:
    import uvicorn

    from gyre_tito.proxy import Proxy, ProxyConfig
    from gyre_tito.server import create_app

    if not (Path(a.tokenizer) / "tokenizer.json").is_file():
        print(f"gyre-tito serve: --tokenizer {a.tokenizer}: no tokenizer.json there", file=sys.stderr)
        return 2
    for url in a.engine:
        if not url.startswith(("http://", "https://")):
            print(f"gyre-tito serve: --engine {url!r}: must be an http(s) URL", file=sys.stderr)
            return 2
    cfg = ProxyConfig(
        engines=a.engine,
        tokenizer=str(Path(a.tokenizer).resolve()),
        store=str(Path(a.store).resolve()),
        model_name=a.model_name,
        admin_token=a.admin_token or os.environ.get("GYRE_TITO_ADMIN_TOKEN"),
        max_context_tokens=a.max_context,
        fsync=not a.no_fsync,
        export_dirs=[str(Path(d).resolve()) for d in a.export_dir],
        context_overflow=a.context_overflow,
        sampling_policy=a.sampling_policy,
        temperature=a.temperature,
    )
    Path(cfg.store).mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(exclude={"admin_token"}) | {"host": a.host, "port": a.port}
    import json

    (Path(cfg.store) / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    proxy = Proxy(cfg)
    # harnesses keep connections open between calls that can be minutes apart (tool runs): long keep-alive
    uvicorn.run(create_app(proxy), host=a.host, port=a.port, log_level=a.log_level, timeout_keep_alive=75)
    return 0


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="gyre-tito", description="Token-in-token-out proxy for agent harnesses."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the proxy (Anthropic + OpenAI APIs over /generate engines)")
    s.add_argument("--engine", action="append", default=[], help="engine base URL (repeatable)")
    s.add_argument("--tokenizer", required=True, help="tokenizer directory (tokenizer.json + chat template)")
    s.add_argument("--store", required=True, help="directory for records, executions and config.json")
    s.add_argument("--port", type=int, default=8787)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--model-name", default="gyre-policy", help="model name reported to harnesses")
    s.add_argument("--admin-token", default=None, help="admin API token (or env GYRE_TITO_ADMIN_TOKEN)")
    s.add_argument("--max-context", type=int, default=131072, help="model context limit in tokens")
    s.add_argument(
        "--export-dir", action="append", default=[], help="admin export may also write under DIR (repeatable)"
    )
    s.add_argument(
        "--context-overflow", choices=["clamp", "refuse"], default="clamp",
        help="max_tokens beyond the room left in the context: clamp it, or refuse in Anthropic's wording",
    )  # fmt: skip
    s.add_argument(
        "--sampling-policy", choices=["pin", "refuse", "pass"], default="pin",
        help="per-call temperature/top_p/top_k: pin to the run's (top_p=1, top_k=-1), refuse others, or pass",
    )  # fmt: skip
    s.add_argument("--temperature", type=float, default=1.0, help="the run's sampling temperature")
    s.add_argument("--no-fsync", action="store_true", help="skip fsync per record (benchmarks only)")
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
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    raise SystemExit(main())
