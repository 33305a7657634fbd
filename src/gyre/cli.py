"""`gyre` command line: the main job and its helpers.

- `gyre demo [--config FILE] [--run-dir DIR] [--steps N] [--set key=value ...]`: the whole loop on this machine
  (embedded default: tiny model, CPU engines, proxy, built-in agent, evaluator, trainer). Prints progress and, as its
  last line, a JSON summary.
- `gyre config [--config FILE] [--set key=value ...]`: print the resolved config without running anything.
- `gyre report RUN`: rebuild RUN/report.html from the run directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from gyre.config import ConfigError, RunConfig, load_config

__all__ = ["main"]


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. algorithm.steps=2")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _resolve(args: argparse.Namespace) -> RunConfig:
    overrides = _overrides(args.set)
    if getattr(args, "run_dir", None):
        overrides["run_dir"] = args.run_dir
    if getattr(args, "steps", None) is not None:
        overrides["algorithm.steps"] = args.steps
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre", description="Gyre: elastic RL for long-horizon LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("demo", "run the whole loop on this machine"),
        ("config", "print the resolved config"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", type=Path, default=None, help="TOML or JSON config file")
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
        )
        if name == "demo":
            p.add_argument("--run-dir", default=None, help="run directory (default runs/<UTC timestamp>)")
            p.add_argument("--steps", type=int, default=None, help="optimizer steps to run")
    r = sub.add_parser("report", help="rebuild RUN/report.html")
    r.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(
        logging.WARNING
    )  # one line per HTTP request drowns the progress lines
    try:
        if args.command == "report":
            from gyre.report import write_report

            if not (args.run_dir / "trace.jsonl").exists():
                print(f"gyre report: {args.run_dir} has no trace.jsonl", file=sys.stderr)
                return 2
            print(write_report(args.run_dir))
            return 0
        cfg = _resolve(args)
    except ConfigError as exc:
        print(f"gyre {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return 0
    from gyre.pipeline import RunDirError, run_local_sync

    try:
        summary = run_local_sync(cfg)
    except RunDirError as exc:
        print(f"gyre demo: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
