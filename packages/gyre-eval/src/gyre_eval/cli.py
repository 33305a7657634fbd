"""``gyre-eval``: run the reward service, or one evaluator once against a workspace."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

from pydantic import ValidationError

CONFIG_FILE = "gyre-eval.config.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre-eval", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the assessment API on a store directory (the run directory)")
    serve.add_argument("--store", required=True, type=Path, help="run directory; holds assessments.sqlite")
    serve.add_argument("--port", required=True, type=int, help="TCP port (0 picks a free one)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    serve.add_argument(
        "--listen-fd",
        type=int,
        help="serve on this inherited bound socket (a launcher's) instead of binding one",
    )
    serve.add_argument(
        "--config", type=Path, help="service config (JSON or TOML): evaluators, retries, advantages"
    )
    serve.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--token-file", help="file (mode 600) with the bearer token every endpoint but /healthz needs"
    )
    serve.add_argument("--token-fd", type=int, help="read that token from this inherited fd instead")
    check = sub.add_parser(
        "check", help="run one configured evaluator once on a workspace and print the verdict"
    )
    check.add_argument("--config", required=True, type=Path)
    check.add_argument("--evaluator", default="task")
    check.add_argument("--workspace", required=True, type=Path)
    check.add_argument("--timeout", type=float, default=600.0, help="seconds from now until the deadline")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from gyre_eval.config import load_config

    try:
        config = load_config(args.config)
    except FileNotFoundError:
        print(f"gyre-eval: config file {args.config} not found", file=sys.stderr)
        return 2
    except (ValidationError, ValueError) as e:
        print(f"gyre-eval: invalid config {args.config}: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(args, config)
    return asyncio.run(_check(args, config))


def _serve(args: argparse.Namespace, config) -> int:
    import uvicorn

    from gyre_eval.server import create_app
    from gyre_sched.secret import read_secret

    try:
        token = read_secret(args.token_file, args.token_fd)
    except ValueError as e:
        print(f"gyre-eval: {e}", file=sys.stderr)
        return 2
    try:  # held by whoever started this service: no other process can take the port, across restarts too
        sockets = None if args.listen_fd is None else [socket.socket(fileno=args.listen_fd)]
    except OSError as e:
        print(f"gyre-eval: --listen-fd {args.listen_fd}: {e.strerror or e}", file=sys.stderr)
        return 2
    args.store.mkdir(parents=True, exist_ok=True)
    # The resolved config comes first, secrets masked (the run's own config.json belongs to the run).
    (args.store / CONFIG_FILE).write_text(json.dumps(config.redacted(), indent=2) + "\n")
    try:
        app = create_app(args.store, config, token=token)
    except ValueError as e:
        print(f"gyre-eval: cannot build evaluators: {e}", file=sys.stderr)
        return 2
    # clients reuse idle connections up to their own expiry (httpx: 5 s); a server keep-alive of the same length lets
    # a request meet the close (an empty ReadError), so the server keeps them much longer
    server_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=75
    )
    server = uvicorn.Server(server_config)
    server.run(sockets=sockets)
    return 0 if server.started else 3  # uvicorn's own status for a server that never started


async def _check(args: argparse.Namespace, config) -> int:
    from gyre_eval.config import build_evaluator
    from gyre_eval.evaluator import EvaluationRequest

    spec = config.evaluators.get(args.evaluator)
    if spec is None:
        print(f"gyre-eval: no evaluator {args.evaluator!r} in {args.config}", file=sys.stderr)
        return 2
    if not args.workspace.is_dir():
        print(f"gyre-eval: workspace {args.workspace} is not a directory", file=sys.stderr)
        return 2
    evaluator = build_evaluator(spec)
    request = EvaluationRequest(
        execution_id="cli",
        workspace=args.workspace,
        artifact_version="cli",
        branch="main",
        deadline=time.time() + args.timeout,
    )
    try:
        verdict = await evaluator.evaluate(request)
    except Exception as e:
        print(json.dumps({"status": "unresolved", "error": f"{type(e).__name__}: {e}"}))
        return 1
    finally:
        await evaluator.aclose()
    print(
        json.dumps(
            {
                "status": "valid",
                "score": verdict.score,
                "critique": verdict.critique,
                "details": verdict.details,
            },
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
