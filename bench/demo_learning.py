"""Does the default `gyre demo` learn, and where does its time go? Three seeded runs of the real demo.

For each seed the default demo runs as a user runs it (`python -m gyre.cli demo --set train.seed=S`, a fresh
process, nothing else changed) and the bench reads what the run left behind:

- reward curve: mean reward per optimizer step (metrics/steps.jsonl); the figure is the ratio of the last quarter
  of steps to the first quarter (the baseline, measured in the same run); the issue's target is >= 2 and a last
  quarter >= 0.3 for 3 of 3 seeds;
- wall time of the whole process (imports included) and of the demo policy's build when it was not cached yet;
- rollout tokens/s: tokens the engines generated (records/: every model call's output ids) per second of rollout
  (the time at least one execution was running); training tokens/s: tokens of the selected trajectories of the
  consumed executions (trajectories/) per second of optimizer steps (steps.jsonl `seconds`);
- the share of time per phase: engine start (process start to the controller's first event, imports and cell
  start-up included) as a share of the whole wall time; then, as shares of the controller's run, the time during
  which at least one execution was running (rollout), one assessment was pending (assessment), a batch was open
  (training) and a publication was under way (publication). The last four overlap (the point of the scheduler),
  so they do not add up to 1;
- calls per execution, executions with 2+ trajectories, steps where 2+ cells claimed micro-steps;
- held-out: the initial and each run's final policy play the same 64 held-out episodes (`gyre.demo.evaluation`: same
  queries, same sampling seed, in this process), so query order and difficulty leave the comparison; the figure is
  final / initial mean reward (the training curve's quarters also differ by which queries each step met).

The machine is shared: wall times measure this machine as it is (the CPU seconds of the run's processes are given
too). `--quick`: one seed and 12 steps (the learning figures then mean little). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq

from gyre.config import RunConfig
from gyre.demo.evaluation import evaluate_policy
from gyre.demo.model import demo_policy
from gyre_sched.trace import iter_trace
from gyre_tito.records import read_log

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) gyre: (.*)$")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _intervals(events: list[dict], start_ev: str, end_ev: str, key: str) -> list[tuple[float, float]]:
    open_at: dict = {}
    out = []
    for e in events:
        if e["ev"] == start_ev:
            open_at.setdefault(e.get(key), e["t"])
        elif e["ev"] == end_ev and e.get(key) in open_at:
            out.append((open_at.pop(e.get(key)), e["t"]))
    return out


def analyse(run_dir: Path, launched_at: float, wall_s: float, stderr: str) -> dict:
    events = list(iter_trace(run_dir / "trace.jsonl"))
    steps = [json.loads(line) for line in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    rewards = [s["mean_reward"] for s in steps]
    q = max(1, len(rewards) // 4)
    first, last = sum(rewards[:q]) / q, sum(rewards[-q:]) / q

    # Engine start: process start to the controller's start (its log line), imports and cell start-up included.
    controller_at = None
    for line in stderr.splitlines():
        m = _STAMP.match(line)
        if m and m.group(2).startswith("running "):
            controller_at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    engine_start_s = (controller_at - launched_at) if controller_at else None
    span = max(e["t"] for e in events)
    rollout = _intervals(events, "launch", "terminate", "execution")
    assessment = _intervals(events, "terminate", "assessed", "execution")
    opened = [e["t"] for e in events if e["ev"] == "batch_open"]
    ended = [e["t"] for e in events if e["ev"] == "step_end"]
    training = list(zip(opened, ended, strict=False))  # the run may end with a batch opened and never trained
    publication = _intervals(events, "publish_begin", "publish", "version")

    records = {
        p.name.split(".tito")[0]: read_log(p).records
        for p in (run_dir / "records" / "records").glob("*.jsonl")
    }
    output_tokens = sum(len(r.output_ids) for recs in records.values() for r in recs)
    calls = [len(recs) for recs in records.values()]
    consumed = {e for s in steps for g in s["group_ids"] for e in records if e.split(".")[0] == g}
    trajectories: Counter = Counter()
    train_tokens = 0
    for path in (run_dir / "trajectories").glob("*.parquet"):
        for row in pq.read_table(path, columns=["execution_id", "token_ids"]).to_pylist():
            trajectories[row["execution_id"]] += 1
            if row["execution_id"] in consumed:
                train_tokens += len(row["token_ids"])
    rollout_s = _union(rollout)
    train_s = sum(s["seconds"] for s in steps)
    build = None
    m = re.search(r"demo policy built in (\d+) s", stderr)
    if m:
        build = float(m.group(1))
    return {
        "steps": len(steps),
        "rewards": [round(r, 4) for r in rewards],
        "first_quarter": round(first, 4),
        "last_quarter": round(last, 4),
        "ratio": round(last / first, 3) if first > 0 else None,
        "passed": bool(first > 0 and last >= 2 * first and last >= 0.3),
        "wall_s": round(wall_s, 1),
        "build_s": build,
        "engine_start_s": round(engine_start_s, 1) if engine_start_s is not None else None,
        "rollout_tok_s": round(output_tokens / rollout_s, 1) if rollout_s else None,
        "train_tok_s": round(train_tokens / train_s, 1) if train_s else None,
        "share": {
            "engine_start": round(engine_start_s / wall_s, 3) if engine_start_s is not None else None,
            "rollout": round(rollout_s / span, 3),
            "assessment": round(_union(assessment) / span, 3),
            "training": round(_union(training) / span, 3),
            "publication": round(_union(publication) / span, 3),
        },
        "controller_s": round(span, 1),
        "calls_per_execution": round(sum(calls) / len(calls), 3),
        "executions_with_2plus_trajectories": sum(n >= 2 for n in trajectories.values()),
        "executions": len(records),
        "steps_with_2plus_cells": sum(
            sum(n > 0 for n in s["microsteps_by_cell"].values()) >= 2 for s in steps
        ),
        "min_microsteps": min(s["num_microsteps"] for s in steps),
    }


def run_demo(seed: int, steps: int | None, root: Path, sets: list[str] = ()) -> dict:
    run_dir = root / f"seed-{seed}"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--run-dir",
        str(run_dir),
        "--set",
        f"train.seed={seed}",
    ]
    if steps is not None:
        argv += ["--steps", str(steps)]
    for kv in sets:
        argv += ["--set", kv]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched_at = time.time()
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: gyre demo failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = analyse(run_dir, launched_at, wall, proc.stderr)
    result["cpu_s"] = round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 1)
    final = run_dir / "checkpoints" / f"policy-v{result['steps']}"
    result["heldout_final"] = round(
        evaluate_policy(final, episodes=HELDOUT, seed=HELDOUT_SEED)["mean_reward"], 4
    )
    return {"seed": seed, **result}


HELDOUT, HELDOUT_SEED = 64, 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 12 steps")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=None, help="default: the demo's own")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a candidate setting, passed to every run (as gyre demo --set)",
    )
    args = parser.parse_args()
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    steps = 12 if args.quick else args.steps
    root = args.keep or Path(tempfile.mkdtemp(prefix="gyre-bench-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    heldout_initial = round(
        evaluate_policy(demo_policy(), episodes=HELDOUT, seed=HELDOUT_SEED)["mean_reward"], 4
    )
    runs = []
    for seed in seeds:
        r = run_demo(seed, steps, root, args.set)
        runs.append(r)
        print(
            f"seed {seed}: reward first quarter {r['first_quarter']:.3f} -> last quarter {r['last_quarter']:.3f} "
            f"(x{r['ratio']}), wall {r['wall_s']:.0f} s (cpu {r['cpu_s']:.0f} s, engine start "
            f"{r['engine_start_s']} s, build {r['build_s']} s), rollout {r['rollout_tok_s']} tok/s, training "
            f"{r['train_tok_s']} tok/s, {r['calls_per_execution']:.2f} calls/execution, shares {r['share']}",
            flush=True,
        )
        print("  rewards " + " ".join(f"{x:.2f}" for x in r["rewards"]), flush=True)
        print(f"  held-out: initial {heldout_initial:.3f} -> final {r['heldout_final']:.3f}", flush=True)
    defaults = RunConfig()
    mean = lambda key: round(sum(r[key] for r in runs) / len(runs), 3)  # noqa: E731
    print(
        json.dumps(
            {
                "bench": "demo_learning",
                "seeds": seeds,
                "steps": runs[0]["steps"],
                "defaults": {
                    "N": defaults.scheduler.N,
                    "B": defaults.scheduler.B,
                    "mu": defaults.scheduler.mu,
                    "phi": defaults.scheduler.phi,
                    "lr": defaults.train.lr,
                },
                "set": args.set,
                "ratio_last_to_first_quarter": [r["ratio"] for r in runs],
                "first_quarter": [r["first_quarter"] for r in runs],
                "last_quarter": [r["last_quarter"] for r in runs],
                "seeds_passed": sum(r["passed"] for r in runs),
                "heldout_initial": heldout_initial,
                "heldout_final": [r["heldout_final"] for r in runs],
                "heldout_ratio": [round(r["heldout_final"] / heldout_initial, 3) for r in runs],
                "wall_s": [r["wall_s"] for r in runs],
                "cpu_s": [r["cpu_s"] for r in runs],
                "build_s": next((r["build_s"] for r in runs if r["build_s"] is not None), None),
                "engine_start_s": [r["engine_start_s"] for r in runs],
                "rollout_tok_s": mean("rollout_tok_s"),
                "train_tok_s": mean("train_tok_s"),
                "share": {
                    k: round(sum(r["share"][k] for r in runs) / len(runs), 3) for k in runs[0]["share"]
                },
                "calls_per_execution": mean("calls_per_execution"),
                "executions_with_2plus_trajectories": [r["executions_with_2plus_trajectories"] for r in runs],
                "steps_with_2plus_cells": [r["steps_with_2plus_cells"] for r in runs],
                "min_microsteps": min(r["min_microsteps"] for r in runs),
                "runs": str(root),
            }
        )
    )


if __name__ == "__main__":
    main()
