"""Local vs Ray placement of the same run: start-up to the first launched execution, role switches, publications.

The same config (the demo's: K=2 cells, tiny model, CPU) runs once with the local launcher (subprocesses) and once
with the ray launcher on a Ray instance this script starts on this machine (`--ray local`: Ray's own start-up is
counted, as a user running `gyre run --ray local` pays it; `--address` joins a running cluster instead). For each:

- start-up: wall time from starting `gyre run` to the first `launch` line in RUN/trace.jsonl (polled every 20 ms);
- role switches: median `total_s` of RUN/metrics/switches.jsonl; publications: median `total_s` of publish.jsonl.

Ratios are Ray / local. Runs alternate (local, ray, local, ray, ...) with --repeats N; medians reported.

    uv run python bench/launch_overhead.py [--quick] [--repeats N] [--address HOST:6379]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
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
    argv = [sys.executable, "-m", "gyre.cli", "demo", "--run-dir", str(run_dir), "--steps", str(steps), "--quiet",
            "--set", "dashboard.enabled=false", "--set", "train.seed=0"]  # fmt: skip
    if kind == "ray":
        argv += ["--ray", address or "local", "--set", "launcher.num_cpus=4"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 step, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: start one here)")
    args = parser.parse_args()
    repeats = args.repeats or 1
    steps = args.steps or (1 if args.quick else 2)
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory(prefix="gyre-launch-") as tmp:
        for r in range(repeats):
            for kind in ("local", "ray"):
                res = run_once(kind, steps, Path(tmp) / f"{r}", args.address)
                runs[kind].append(res)
                print(f"{kind} #{r}: {json.dumps(res)}", file=sys.stderr)

    def med(kind: str, key: str) -> float | None:
        values = [x[key] for x in runs[kind] if x[key] is not None]
        return round(statistics.median(values), 4) if values else None

    out: dict = {"bench": "launch_overhead", "steps": steps, "repeats": repeats, "cpus": os.cpu_count(),
                 "load_avg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
    for key in ("startup_to_first_launch_s", "switch_s", "publish_s", "wall_s"):
        local, ray = med("local", key), med("ray", key)
        out[key] = {
            "local": local,
            "ray": ray,
            "ray_over_local": round(ray / local, 3) if local and ray else None,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
