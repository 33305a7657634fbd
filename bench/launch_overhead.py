"""A cell worker's start, a baseline commit against this tree; and local vs Ray placement of the same run.

Section `worker` (the default): one cell worker (`gyre-cell worker`, an elastic cell of one: its torch engine and its
training side, each loading the model; the demo's policy unless --model) is started as a plain process, as the
launcher does without its zygote, from the baseline tree and from this one, alternating (A B A B), after one
unmeasured start of each ("after the first run": caches and bytecode written by a first start are there). The
baseline is a `git worktree` of `--baseline` (default HEAD, so uncommitted work is the candidate), put first on
PYTHONPATH; both trees' sources are compiled to bytecode first, as CI does. Per start: `ready_s`, wall time from the
process's start to its `/cell/status` answering ready (polled every 20 ms), and `cpu_s`, the worker's user + system
CPU until it exits (asked to shut down once ready). Medians, min-max spread, candidate / baseline ratios.

Section `launchers`: the same config (the demo's: K=2 cells, tiny model, CPU) runs once with the local launcher
(subprocesses) and once with the ray launcher on a Ray instance this script starts on this machine (`--ray local`:
Ray's own start-up is counted, as a user running `gyre run --ray local` pays it; `--address` joins a running cluster
instead). For each:

- start-up: wall time from starting `gyre run` to the first `launch` line in RUN/trace.jsonl (polled every 20 ms);
- role switches: median `total_s` of RUN/metrics/switches.jsonl; publications: median `total_s` of publish.jsonl.

Ratios are Ray / local. Runs alternate (local, ray, local, ray, ...) with --repeats N; medians reported.

    uv run python bench/launch_overhead.py [--quick] [--repeats N] [--baseline REV] [--model DIR]
    uv run python bench/launch_overhead.py --sections launchers [--quick] [--repeats N] [--address HOST:6379]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def run_once(kind: str, steps: int, out: Path, address: str | None) -> dict:
    run_dir = out / kind
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--quiet",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "train.seed=0",
    ]
    if kind == "ray":
        argv += ["--ray", address or "local", "--set", "launcher.num_cpus=4"]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    trace, first_launch = run_dir / "trace.jsonl", None
    while proc.poll() is None and first_launch is None:
        if trace.exists() and b'"ev":"launch"' in trace.read_bytes():
            first_launch = time.monotonic() - t0
        else:
            time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}: gyre demo failed:\n{stderr[-3000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    switches = [
        json.loads(x)["total_s"] for x in (run_dir / "metrics" / "switches.jsonl").read_text().splitlines()
    ]
    publishes = [
        json.loads(x)["total_s"] for x in (run_dir / "metrics" / "publish.jsonl").read_text().splitlines()
    ]
    return {
        "startup_to_first_launch_s": first_launch,
        "wall_s": time.monotonic() - t0,
        "steps": summary["steps"],
        "switch_s": statistics.median(switches) if switches else None,
        "publish_s": statistics.median(publishes) if publishes else None,
    }


SOURCES = ["src", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "packages").glob("*/src"))]


def stats(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def worker_config(model: str, run_dir: Path) -> str:
    """An elastic cell of one on CPU (engine + training side), on free ports, as JSON."""
    from gyre_cell.engine.config import EngineConfig
    from gyre_cell.ports import free_ports
    from gyre_cell.worker_types import CellTrainingConfig, CellWorkerConfig

    http, master, coordinator = free_ports(3)
    return CellWorkerConfig(
        cell=0,
        num_cells=1,
        run_dir=str(run_dir),
        port=http,
        engine=EngineConfig(model_path=model, device="cpu", weight_version="0"),
        training=CellTrainingConfig(
            group_size=2, batch_groups=1, lr=1e-3, master_port=master, coordinator_port=coordinator
        ),
    ).model_dump_json()


def start_worker(tree: Path, model: str, run_dir: Path) -> dict:
    """Start one worker from `tree`; time to ready, then shut it down; its CPU seconds."""
    import httpx

    run_dir.mkdir(parents=True)
    config = run_dir / "worker.json"
    config.write_text(worker_config(model, run_dir))
    port = json.loads(config.read_text())["port"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / s) for s in SOURCES)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with (run_dir / "worker.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gyre_cell.cli", "worker", "--config", str(config)],
            cwd=tree,
            env=env,
            stdout=log,
            stderr=log,
        )
    ready, url = None, f"http://127.0.0.1:{port}/cell"
    with httpx.Client(timeout=5.0) as http:
        while ready is None:
            if proc.poll() is not None:
                raise SystemExit(f"{tree}: worker exited:\n{(run_dir / 'worker.log').read_text()[-3000:]}")
            try:
                if http.get(f"{url}/status").json().get("ready"):
                    ready = time.monotonic() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        http.post(f"{url}/shutdown")
    proc.wait(timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"ready_s": ready, "cpu_s": cpu}


def worker_section(args: argparse.Namespace, tmp: Path) -> dict:
    model = args.model
    if model is None:
        from gyre.demo.model import demo_policy

        model = str(demo_policy())
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.baseline], cwd=ROOT, check=True, text=True, capture_output=True
    ).stdout.strip()
    repeats = args.repeats or (2 if args.quick else 4)
    tmp.mkdir(parents=True)
    base = tmp / "baseline-tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), rev], cwd=ROOT, check=True)
    runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
    try:
        for tree in (base, ROOT):
            subprocess.run(
                [sys.executable, "-m", "compileall", "-q", "-j", "0", *(str(tree / s) for s in SOURCES)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        for name, tree in (("baseline", base), ("candidate", ROOT)):  # the first run of each: not measured
            start_worker(tree, model, tmp / f"warm-{name}")
        for r in range(repeats):
            for name, tree in (("baseline", base), ("candidate", ROOT)):
                res = start_worker(tree, model, tmp / f"{name}-{r}")
                runs[name].append(res)
                print(
                    f"worker {name} #{r}: {json.dumps({k: round(v, 2) for k, v in res.items()})}",
                    file=sys.stderr,
                )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    out: dict = {"baseline": rev, "model": model, "repeats": repeats}
    for key in ("ready_s", "cpu_s"):
        base_v, cand_v = ([x[key] for x in runs[n]] for n in ("baseline", "candidate"))
        out[key] = {
            "baseline": stats(base_v),
            "candidate": stats(cand_v),
            "ratio": round(statistics.median(cand_v) / statistics.median(base_v), 3),
        }
    return out


def launchers_section(args: argparse.Namespace, tmp: Path) -> dict:
    repeats = args.repeats or 1
    steps = args.steps or (1 if args.quick else 2)
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    for r in range(repeats):
        for kind in ("local", "ray"):
            res = run_once(kind, steps, tmp / f"{r}", args.address)
            runs[kind].append(res)
            print(f"{kind} #{r}: {json.dumps(res)}", file=sys.stderr)

    def med(kind: str, key: str) -> float | None:
        values = [x[key] for x in runs[kind] if x[key] is not None]
        return round(statistics.median(values), 4) if values else None

    out: dict = {"steps": steps, "repeats": repeats}
    for key in ("startup_to_first_launch_s", "switch_s", "publish_s", "wall_s"):
        local, ray = med("local", key), med("ray", key)
        out[key] = {
            "local": local,
            "ray": ray,
            "ray_over_local": round(ray / local, 3) if local and ray else None,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="worker", help="comma-separated: worker, launchers")
    parser.add_argument("--quick", action="store_true", help="worker: 2 rounds; launchers: 1 step, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (worker: default 4; launchers: 1)")
    parser.add_argument(
        "--baseline", default="HEAD", help="worker: the commit to compare against (default HEAD)"
    )
    parser.add_argument(
        "--model", default=None, help="worker: checkpoint directory (default: the demo policy)"
    )
    parser.add_argument("--steps", type=int, default=None, help="launchers: demo steps")
    parser.add_argument(
        "--address", default=None, help="launchers: a running Ray cluster (default: start one)"
    )
    args = parser.parse_args()
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if unknown := set(sections) - {"worker", "launchers"}:
        parser.error(f"unknown sections: {sorted(unknown)}")
    out: dict = {
        "bench": "launch_overhead",
        "cpus": os.cpu_count(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory(prefix="gyre-launch-") as tmp:
        if "worker" in sections:
            out["worker"] = worker_section(args, Path(tmp) / "worker")
        if "launchers" in sections:
            out["launchers"] = launchers_section(args, Path(tmp) / "launchers")
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
