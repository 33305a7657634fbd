"""A stand-in for `python -m sglang.launch_server` where SGLang cannot run (no GPU): a public test helper.

It takes the flags `gyre_cell.sglang_adapter.build_launch_command` writes, reads the API key from the `--config` YAML
file as SGLang does (never from argv), and serves the CPU torch engine, which speaks the subset of SGLang's HTTP
protocol Gyre uses, on `--host`/`--port`. So a cell worker configured for SGLang (`CellWorkerConfig.sglang` with
`module = STAND_IN`) starts, supervises, authenticates, switches and updates a separate server process exactly as
it would SGLang's; only the tensor format of `/update_weights_from_tensor` differs (the torch engine's base64
safetensors: `SGLangServer.client()` picks the matching client), and, like SGLang, it pins no KV for migration
(a request moved off it is recomputed). What it cannot show is SGLang's own behaviour:
that is what the `gpu`-marked tests run against the real server.

Flags SGLang takes and the stand-in does not need (memory fraction, parsers, memory saver) are accepted and ignored;
`--tp-size` must be 1 (the torch engine has one rank). `--device` and `--cpu-threads` are the stand-in's own
(give them through `SGLangLaunchConfig.extra_args`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gyre_cell.testing.sglang_stand_in", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--config", default=None, help="SGLang's YAML config: only `api-key` is read")
    p.add_argument("--load-format", default=None, choices=["auto", "safetensors", "dummy"])
    for ignored in (
        "--mem-fraction-static",
        "--tool-call-parser",
        "--reasoning-parser",
        "--served-model-name",
    ):
        p.add_argument(ignored, default=None)
    for ignored in ("--enable-memory-saver", "--enable-weights-cpu-backup", "--skip-tokenizer-init"):
        p.add_argument(ignored, action="store_true")
    p.add_argument("--device", default="cpu", help="the stand-in's own: where the torch engine runs")
    p.add_argument("--cpu-threads", type=int, default=1, help="the stand-in's own: torch intra-op threads")
    return p


def read_api_key(config_path: str) -> str:
    """`api-key` of SGLang's YAML config as `write_api_key_config` writes it (a JSON string is a YAML string)."""
    for line in Path(config_path).read_text().splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "api-key":
            return str(json.loads(value.strip()))
    raise ValueError(f"{config_path}: no api-key")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tp_size != 1:
        print(f"sglang stand-in: --tp-size {args.tp_size}: the torch engine has one rank", file=sys.stderr)
        return 2
    try:
        api_key = read_api_key(args.config) if args.config else None
    except (OSError, ValueError) as exc:
        print(f"sglang stand-in: --config: {exc}", file=sys.stderr)
        return 2
    import torch

    from gyre_cell.cli import serve_torch_engine
    from gyre_cell.engine import EngineConfig

    torch.set_num_threads(args.cpu_threads)
    cfg = EngineConfig(
        model_path=args.model_path,
        device=args.device,
        weight_version=args.weight_version,
        seed=args.random_seed,
        cpu_threads=args.cpu_threads,
        kv_migration=False,  # as SGLang 0.5.23: no KV pins
    )
    return serve_torch_engine(cfg, args.host, args.port, api_key)


if __name__ == "__main__":
    sys.exit(main())
