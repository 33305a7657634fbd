"""`gyre` command line: the main job and its helpers.

- `gyre run CONFIG [--run-dir DIR] [--steps N] [--set key=value ...]`: a run from a TOML/JSON config (the production
  entry point): cell worker processes, standalone engines, proxy, evaluator, controller.
- `gyre demo [--config FILE] [...]`: the `demo` preset of `gyre run` on this machine (tiny model, CPU cells); same
  code path. Prints progress and, as its last line, a JSON summary.
- `gyre config [--config FILE] [--set key=value ...] [--explain] [--json]`: print the resolved config without
  running anything, each value with where it came from (default, file, --set); `--explain` adds each field's
  description, `--json` prints the config alone as JSON.
- `gyre report RUN`: rebuild RUN/report.html from the run directory.
- `gyre --version`: the installed version of the `gyre-rl` distribution (the meta-package; `gyre` on the index is another project).

`gyre --help`, `gyre --version` and `gyre config` import no torch (tests/test_cli_door.py): this module and
gyre.config import only light modules at the top, every command its heavy ones when it runs. `gyre run` and
`gyre demo` refuse a `[model] path` they cannot load in one line (exit 2) before any process starts.

With `[launcher] controller_resources` (Ray), `gyre run` places the controller on a cluster node and follows it
(gyre.launch.placed): its log on stderr, its summary on stdout, its exit status.

SIGINT or SIGTERM stops a run: every child process is ended, one line says what was interrupted, the exit status is
128 + the signal number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

from gyre.config import ConfigError, RunConfig, check_model_path, load_config, resolve_transports

__all__ = ["main"]


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. train.steps=2")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _resolve(args: argparse.Namespace, sources: dict[str, str] | None = None) -> RunConfig:
    overrides = _overrides(args.set)
    if getattr(args, "run_dir", None):
        overrides["run_dir"] = args.run_dir
    if getattr(args, "steps", None) is not None:
        overrides["train.steps"] = args.steps
    if getattr(args, "ray", None):
        overrides["launcher.kind"] = "ray"
        overrides["launcher.address"] = None if args.ray == "local" else args.ray
    return load_config(args.config, overrides, sources)


DISTRIBUTION = "gyre-rl"
"""The meta-package's distribution name, whose version `gyre --version` prints."""


class _Version(argparse.Action):
    """`--version`: the installed distribution's version, looked up only when asked (argparse's own "version"
    action takes the string up front, which would read the package metadata on every command)."""

    def __init__(
        self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version(DISTRIBUTION)
        except PackageNotFoundError:
            parser.exit(2, f"{parser.prog}: the {DISTRIBUTION!r} distribution is not installed\n")
        print(f"{parser.prog} {text}")  # on stdout, as argparse's own version action prints it
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre", description="Gyre: elastic RL for long-horizon LLM agents.")
    parser.add_argument("--version", action=_Version, help="print the installed version of gyre and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("run", "a run from a config file (cells as processes, every scheduler policy)"),
        ("demo", "the demo preset of `gyre run`: the whole loop on this machine"),
        ("config", "print the resolved config"),
    ):
        p = sub.add_parser(name, help=text)
        if name == "run":
            p.add_argument("config", type=Path, nargs="?", help="TOML or JSON config file")
            p.add_argument(
                "--resume",
                type=Path,
                default=None,
                metavar="RUN_DIR",
                help="continue an interrupted run from its last step checkpoint (its own config; "
                "--steps may raise the total)",
            )
        else:
            p.add_argument("--config", type=Path, default=None, help="TOML or JSON config file")
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
        )
        if name == "config":
            p.add_argument("--explain", action="store_true", help="print each field's description above it")
            p.add_argument(
                "--json", action="store_true", help="print the resolved config as JSON, nothing else"
            )
        else:
            p.add_argument("--run-dir", default=None, help="run directory (default runs/<UTC timestamp>)")
            p.add_argument("--steps", type=int, default=None, help="optimizer steps to run")
            p.add_argument(
                "--ray",
                default=None,
                metavar="ADDRESS",
                help="place cells on a Ray cluster (auto, HOST:PORT, or local for a Ray instance "
                "on this machine); same as [launcher] kind = 'ray'",
            )
            p.add_argument("--quiet", action="store_true", help="warnings and errors only, no progress bar")
            p.add_argument("--placed-controller", default=None, help=argparse.SUPPRESS)  # gyre.launch.placed
            p.add_argument(
                "--log-format",
                choices=["text", "json"],
                default="text",
                help="stderr as text with a progress bar, or one JSON object per line",
            )
    r = sub.add_parser("report", help="rebuild RUN/report.html")
    r.add_argument("run_dir", type=Path)
    t = sub.add_parser("tasks", help="task datasets (gyre.datasets)")
    tsub = t.add_subparsers(dest="tasks_command", required=True)
    tv = tsub.add_parser("validate", help="check a task file (JSONL, Parquet or dataset folder): one line")
    tv.add_argument("file", type=Path)
    return parser


async def _run_until_signal(cfg: RunConfig, command: str, resume=None) -> int:
    try:  # here, in the process that runs the controller (a placed one on its node), before anything starts
        check_model_path(cfg)
        if resume is None:  # the weight transport: Mooncake where it loads, else HTTP (one line says so)
            cfg, note = resolve_transports(cfg)
            if note is not None:
                logging.getLogger("gyre").warning(note)
        if cfg.rollout.engine != "torch":  # what the run does without Gyre's KV pins, said once at start
            logging.getLogger("gyre").warning(
                "rollout on %s: its servers pin no KV for another engine, so a call moved off one (a role switch) "
                "is recomputed where it goes",
                {"sglang": "SGLang", "vllm": "vLLM"}[cfg.rollout.engine],
            )
    except ConfigError as exc:
        print(f"gyre {command}: {exc}", file=sys.stderr)
        return 2
    from gyre.launch import make_launcher

    services = make_launcher(cfg, resume.run_dir if resume else None)
    services.warm_up(cfg)  # before the controller's own imports: the cells' start overlaps them
    from gyre.run.pipeline import RunDirError, run

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    caught: list[int] = []

    def on_signal(signum: int) -> None:
        if not caught:
            caught.append(signum)
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        summary = await run(cfg, services, resume)
    except asyncio.CancelledError:
        if not caught:
            raise
        services.stop()  # idempotent: run()'s finally blocks already ended what they reached
        name = signal.Signals(caught[0]).name
        steps = services.run_dir / "metrics" / "steps.jsonl"
        done = len(steps.read_text().splitlines()) if steps.exists() else 0
        print(
            f"gyre {command}: interrupted by {name} after {done}/{cfg.train.steps} steps; every process stopped; "
            f"run directory {services.run_dir}",
            file=sys.stderr,
        )
        return 128 + caught[0]
    except (RunDirError, ConfigError) as exc:  # found only at launch (the GPUs this process was given)
        services.stop()  # what warm_up started (run() had not begun its own clean-up)
        print(f"gyre {command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a part failed: one clear line, the details are in the run's logs
        services.stop()
        logging.getLogger("gyre").debug("run failed", exc_info=True)
        print(f"gyre {command}: run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


def _join(cfg: RunConfig, gcs: str) -> None:
    """The placed controller joins the cluster that placed it (its launcher finds Ray connected). The run's config
    keeps the user's address: a resume places the controller again from it."""
    from gyre.launch.ray import connect

    connect(cfg.launcher.model_copy(update={"address": gcs}))


def _place(cfg: RunConfig, argv: list[str], run_dir: Path, command: str) -> int:
    """`[launcher] controller_resources`: the controller runs on a Ray node; this process follows it."""
    from gyre.launch import ServiceError
    from gyre.launch.placed import run_placed

    try:
        return run_placed(cfg, argv, run_dir.resolve(), command)
    except ServiceError as exc:
        print(f"gyre {command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # joining the cluster failed: one line, no traceback
        print(f"gyre {command}: placing the controller failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    from gyre.observe import progress

    progress.setup(quiet=getattr(args, "quiet", False), log_format=getattr(args, "log_format", "text"))
    if args.command == "tasks":
        from gyre.datasets import validate_main

        return validate_main(str(args.file))
    try:
        if args.command == "report":
            from gyre.observe.report import write_report

            if not (args.run_dir / "trace.jsonl").exists():
                print(f"gyre report: {args.run_dir} has no trace.jsonl", file=sys.stderr)
                return 2
            print(write_report(args.run_dir))
            return 0
        if getattr(args, "resume", None) is not None:
            from gyre.run.resume import ResumeError, find_resume_point

            if args.config is not None or args.set or args.run_dir or args.ray:
                print(
                    "gyre run: --resume takes the run's own config; only --steps may be given with it",
                    file=sys.stderr,
                )
                return 2
            try:
                resume = find_resume_point(args.resume, args.steps)
            except ResumeError as exc:
                print(f"gyre run: cannot resume: {exc}", file=sys.stderr)
                return 2
            if args.placed_controller:
                _join(resume.cfg, args.placed_controller)
            elif resume.cfg.launcher.controller_resources is not None:
                return _place(resume.cfg, argv, resume.run_dir, args.command)
            return asyncio.run(_run_until_signal(resume.cfg, args.command, resume))
        if args.command == "run" and args.config is None:
            print("gyre run: a config file is needed (or --resume RUN_DIR)", file=sys.stderr)
            return 2
        sources: dict[str, str] = {}
        cfg = _resolve(args, sources)
    except ConfigError as exc:
        print(f"gyre {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        if args.json:
            print(json.dumps(cfg.model_dump(mode="json"), indent=2))
        else:
            from gyre.config_view import render

            print(render(cfg, sources, explain=args.explain))
        return 0
    if args.placed_controller:
        _join(cfg, args.placed_controller)
    elif cfg.launcher.controller_resources is not None:  # both processes must know the run directory
        run_dir = Path(cfg.run_dir or time.strftime("runs/%Y%m%d-%H%M%S", time.gmtime())).resolve()
        if (run_dir / "trace.jsonl").exists():  # refused before anything is written there
            print(
                f"gyre {args.command}: {run_dir} already holds a run (trace.jsonl); choose another --run-dir",
                file=sys.stderr,
            )
            return 2
        return _place(cfg, [*argv, "--run-dir", str(run_dir)], run_dir, args.command)
    return asyncio.run(_run_until_signal(cfg, args.command))


if __name__ == "__main__":
    sys.exit(main())
