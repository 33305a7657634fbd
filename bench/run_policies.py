"""Elastic vs Async vs Colocate, run for real on this machine at matched E[d], plus the simulator's prediction of each.

The same seeded workload runs under each policy with equal expected staleness E[d] = phi + (mu - 1) / 2 (eq. 2):

    E[d] = 1.0   elastic mu=2 phi=0.5     async mu=1 phi=1.0     colocate mu=3 phi=0
    E[d] = 1.5   elastic mu=3 phi=0.5     async mu=1 phi=1.5     colocate mu=4 phi=0

Async's split (training cells out of K = 3) is swept in the first repeat and the best one runs in the others; every
split's time is reported. The workload is the demo's tasks (the default), or with `--workload nl2repo-scaled` the
paper's 122B workload on a clock 720 times as fast (gyre_sched.presets.NL2REPO_SCALED), played by
gyre_sched.workload_harness: long per-execution tails, hard queries whose executions end together at the common
harness timeout, evaluations that fail and are retried within the budget.

For each run it reports wall time per step (trace time of the last step_end / steps), the real speedups of Elastic,
and two simulator predictions: `gyre_sched.replay.predict` replaying the run's own executions, and (with a workload)
the simulator running the workload definition itself with the costs measured in the run (`sim_def`): |sim - real| /
real. Policies alternate in ABAB order across repeats (medians, spread). Without --workload it also runs Elastic with
weights.transport = "disk" and compares the publication times (metrics/publish.jsonl).

    uv run python bench/run_policies.py [--quick] [--repeats N] [--workload nl2repo-scaled] [--staleness 1.0 1.5]

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

from gyre.workload_tasks import workload_run_files
from gyre_sched.config import WorkloadConfig
from gyre_sched.presets import WORKLOADS
from gyre_sched.replay import predict
from gyre_sched.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
K = 3
COMMON = [
    f"cluster.cells={K}",
    "cluster.executions_per_cell=4",
    "scheduler.N=4",
    "scheduler.B=2",
    "scheduler.tau_s=0.5",
    "train.tokens_per_shard=96",
    "train.seed=0",
    "dashboard.enabled=false",
]
WORKLOAD_COMMON = ["scheduler.k_spare=1", "assessment.retry_wait_min_s=0", "assessment.retry_wait_max_s=0"]
"""With a workload: the paper's one spare per group, and retries as the simulator has them (no back-off)."""


def policies(staleness: float, async_cells: int) -> dict[str, list[str]]:
    """Each policy's settings at E[d] = staleness (eq. 2)."""
    mu_elastic = 2 if staleness < 1.5 else 3
    return {
        "elastic": [
            "scheduler.kind=elastic",
            f"scheduler.mu={mu_elastic}",
            f"scheduler.phi={staleness - (mu_elastic - 1) / 2}",
        ],
        "async": [
            "scheduler.kind=async",
            "scheduler.mu=1",
            f"scheduler.phi={staleness}",
            f"scheduler.async_train_cells={async_cells}",
        ],
        "colocate": [
            "scheduler.kind=colocate",
            f"scheduler.mu={round(2 * staleness + 1)}",
            "scheduler.phi=0.0",
        ],
    }


def run_once(name: str, sets: list[str], steps: int, out: Path, workload: WorkloadConfig | None) -> dict:
    run_dir = out / name
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
    ]
    extra = []
    if workload is not None:
        _, extra = workload_run_files(workload, 0, out / f"{name}-workload")
        extra += WORKLOAD_COMMON
    for s in COMMON + extra + sets:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: gyre demo failed:\n{proc.stderr[-3000:]}")
    trace = read_trace(run_dir / "trace.jsonl")
    real = trace.end_time_s
    predicted = predict(run_dir / "trace.jsonl").total_s
    publishes = [json.loads(x) for x in (run_dir / "metrics" / "publish.jsonl").read_text().splitlines()]
    result = {
        "wall_s": real,
        "s_per_step": real / max(1, trace.steps),
        "sim_s": predicted,
        "sim_error": abs(predicted - real) / real,
        "mean_staleness": trace.mean_staleness(),
        "publish_s": statistics.median(p["total_s"] for p in publishes),
    }
    if workload is not None:
        by_definition = predict(run_dir / "trace.jsonl", workload=workload, seed=0).total_s
        result |= {"sim_def_s": by_definition, "sim_def_error": abs(by_definition - real) / real}
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="6 steps, one repeat, E[d] = 1.0 only")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 12; --quick 6)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=None)
    ap.add_argument("--staleness", type=float, nargs="+", default=[1.0], help="E[d] targets (1.0 and/or 1.5)")
    ap.add_argument(
        "--async-splits", type=int, nargs="+", default=[1, 2], help="Async's training cells to sweep"
    )
    ap.add_argument(
        "--time-scale", type=float, default=1.0, help="the workload's clock, again this much faster"
    )
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 12)
    repeats = 1 if args.quick else args.repeats
    targets = [1.0] if args.quick else args.staleness
    workload = None
    if args.workload:
        workload = WorkloadConfig.model_validate(WORKLOADS[args.workload]).scaled(args.time_scale)
    results: dict[str, list[dict]] = {}
    best_split: dict[float, int] = {}
    split_s: dict[str, float] = {}

    def record(key: str, res: dict) -> None:
        results.setdefault(key, []).append(res)
        print(json.dumps({"run": key, **res}), flush=True)

    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
        for r in range(repeats):
            for e in targets:
                names = ["elastic", "async", "colocate"]
                for name in names if r % 2 == 0 else list(reversed(names)):  # ABAB
                    key = f"{name}@{e}"
                    if name == "async" and e not in best_split:  # the sweep, in the first repeat
                        for cells in args.async_splits:
                            res = run_once(
                                f"{key}-split{cells}-{r}",
                                policies(e, cells)["async"],
                                steps,
                                Path(tmp),
                                workload,
                            )
                            split_s[f"async@{e}_split{cells}_s_per_step"] = round(res["s_per_step"], 3)
                            if e not in best_split or res["wall_s"] < min(x["wall_s"] for x in results[key]):
                                best_split[e] = cells
                                results[key] = [res]
                        print(
                            json.dumps({"run": key, "best_split": best_split[e], **results[key][0]}),
                            flush=True,
                        )
                        continue
                    sets = policies(e, best_split.get(e, args.async_splits[0]))[name]
                    record(key, run_once(f"{key}-{r}", sets, steps, Path(tmp), workload))
            if workload is None:
                disk = run_once(
                    f"elastic_disk-{r}",
                    [*policies(1.0, 2)["elastic"], "weights.transport=disk"],
                    steps,
                    Path(tmp),
                    None,
                )
                record("elastic_disk", disk)

    def med(key: str, field: str) -> float:
        return statistics.median(x[field] for x in results[key])

    def spread(key: str, field: str) -> float:
        vals = [x[field] for x in results[key]]
        return max(vals) - min(vals)

    summary: dict = {
        "bench": "run_policies",
        "workload": args.workload or "demo",
        "time_scale": args.time_scale,
        "steps": steps,
        "repeats": repeats,
    }
    for e in targets:
        keys = [f"{p}@{e}" for p in ("elastic", "async", "colocate")]
        summary |= {f"{k}_s_per_step": round(med(k, "s_per_step"), 3) for k in keys}
        summary |= {f"{k}_spread_s_per_step": round(spread(k, "s_per_step"), 3) for k in keys}
        summary |= {f"{k}_runs": len(results[k]) for k in keys}
        summary[f"async@{e}_best_split"] = best_split.get(e)
        summary[f"speedup_vs_async@{e}"] = round(med(keys[1], "wall_s") / med(keys[0], "wall_s"), 3)
        summary[f"speedup_vs_colocate@{e}"] = round(med(keys[2], "wall_s") / med(keys[0], "wall_s"), 3)
        summary |= {f"{k}_sim_error": round(med(k, "sim_error"), 3) for k in keys}
        if workload is not None:
            summary |= {f"{k}_sim_def_error": round(med(k, "sim_def_error"), 3) for k in keys}
        summary |= {f"{k}_mean_staleness": round(med(k, "mean_staleness"), 3) for k in keys}
    summary |= split_s
    if workload is None:
        summary |= {
            "publish_s": round(med("elastic@1.0", "publish_s"), 4) if 1.0 in targets else None,
            "publish_disk_s": round(med("elastic_disk", "publish_s"), 4),
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
