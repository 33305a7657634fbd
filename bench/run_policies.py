"""Elastic vs Async vs Colocate, run for real on this machine at matched E[d], plus the simulator's prediction of each.

The same seeded workload (the demo's tasks, seed, tiny model, K cells, N, B) runs under each policy with equal
expected staleness E[d] = phi + (mu - 1) / 2 (eq. 2):

    elastic   mu=2, phi=0.5        async   mu=1, phi=1.0 (fixed 2+1 split)        colocate   mu=3, phi=0

For each run it reports wall time per step (trace time of the last step_end / steps), the real speedups of Elastic,
and what `gyre_sched.replay.predict` makes of the run's own trace: |sim - real| / real. It also runs Elastic once
more with weights.transport = "disk" and compares the publication times (metrics/publish.jsonl) of the two runs.
Policies run one after another in ABAB order when --repeats > 1 (medians, spread).

    uv run python bench/run_policies.py [--quick] [--repeats N]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gyre_sched.replay import predict
from gyre_sched.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]

POLICIES = {
    "elastic": ["scheduler.kind=elastic", "scheduler.mu=2", "scheduler.phi=0.5"],
    "async": ["scheduler.kind=async", "scheduler.mu=1", "scheduler.phi=1.0", "scheduler.async_train_cells=2"],
    "colocate": ["scheduler.kind=colocate", "scheduler.mu=3", "scheduler.phi=0.0"],
}
COMMON = ["cluster.cells=3", "cluster.executions_per_cell=4", "scheduler.N=4", "scheduler.B=2",
          "scheduler.tau_s=0.5", "train.tokens_per_shard=96", "train.seed=0"]  # fmt: skip


def run_once(name: str, sets: list[str], steps: int, out: Path) -> dict:
    run_dir = out / name
    argv = [sys.executable, "-m", "gyre.cli", "demo", "--run-dir", str(run_dir), "--steps", str(steps)]
    for s in COMMON + sets:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: gyre demo failed:\n{proc.stderr[-3000:]}")
    trace = read_trace(run_dir / "trace.jsonl")
    real = trace.end_time_s
    predicted = predict(run_dir / "trace.jsonl").total_s
    publishes = [json.loads(x) for x in (run_dir / "metrics" / "publish.jsonl").read_text().splitlines()]
    return {
        "wall_s": real,
        "s_per_step": real / max(1, trace.steps),
        "sim_s": predicted,
        "sim_error": abs(predicted - real) / real,
        "mean_staleness": trace.mean_staleness(),
        "publish_s": statistics.median(p["total_s"] for p in publishes),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="6 steps, one repeat")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    steps = 6 if args.quick else 12
    repeats = 1 if args.quick else args.repeats
    results: dict[str, list[dict]] = {k: [] for k in [*POLICIES, "elastic_disk"]}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
        for r in range(repeats):
            order = list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))  # ABAB
            for name in order:
                res = run_once(f"{name}-{r}", POLICIES[name], steps, Path(tmp))
                results[name].append(res)
                print(json.dumps({"policy": name, "repeat": r, **res}), flush=True)
            disk = run_once(
                f"elastic_disk-{r}", [*POLICIES["elastic"], "weights.transport=disk"], steps, Path(tmp)
            )
            results["elastic_disk"].append(disk)
            print(json.dumps({"policy": "elastic_disk", "repeat": r, **disk}), flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in results[name])

    def spread(name: str, key: str) -> float:
        vals = [x[key] for x in results[name]]
        return max(vals) - min(vals)

    summary = {
        "bench": "run_policies",
        "steps": steps,
        "repeats": repeats,
        **{f"{p}_s_per_step": round(med(p, "s_per_step"), 3) for p in POLICIES},
        **{f"{p}_spread_s_per_step": round(spread(p, "s_per_step"), 3) for p in POLICIES},
        "speedup_vs_async": round(med("async", "wall_s") / med("elastic", "wall_s"), 3),
        "speedup_vs_colocate": round(med("colocate", "wall_s") / med("elastic", "wall_s"), 3),
        **{f"{p}_sim_error": round(med(p, "sim_error"), 3) for p in POLICIES},
        **{f"{p}_mean_staleness": round(med(p, "mean_staleness"), 3) for p in POLICIES},
        "publish_mooncake_s": round(med("elastic", "publish_s"), 4),
        "publish_disk_s": round(med("elastic_disk", "publish_s"), 4),
        "publish_ratio_disk_over_mooncake": round(
            med("elastic_disk", "publish_s") / med("elastic", "publish_s"), 3
        ),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
