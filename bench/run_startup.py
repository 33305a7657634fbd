"""A short `gyre demo`'s fixed cost, a baseline commit against this tree: start-up, the run, the end; wall and CPU.

Every end-to-end test and every user's first try pays a run's start (imports, cell workers, proxy, gyre-eval) and end
(final save, stopping the services, the report) around its few steps; on a 2-core machine running two such runs
side by side (CI), the CPU they burn decides the wall time. Each round runs the same 1-step demo once from the
baseline tree and once from this one, alternating (ABAB), with the same interpreter and environment: the baseline
is a `git worktree` of `--baseline` (default HEAD, so uncommitted work is the candidate), put first on PYTHONPATH.
Both trees' sources are compiled to bytecode first (CI compiles them: `.ci/run`).

Per run: `to_launch_s` (start to the first `launch` line in RUN/trace.jsonl, polled every 20 ms), `wall_s` (to the
process's exit) and `cpu_s` (user + system CPU of the run and every process it started and waited for; a process
forked by the zygote is its child's, and the zygote is the run's).

    uv run python bench/run_startup.py [--quick] [--repeats N] [--baseline REV] [--steps N]

Last line: one JSON object (medians, min-max spread, candidate / baseline ratios).
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
SOURCES = ["src", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "packages").glob("*/src"))]


def source_path(tree: Path) -> str:
    return os.pathsep.join(str(tree / s) for s in SOURCES)


def compile_tree(tree: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *(str(tree / s) for s in SOURCES)],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def run_once(tree: Path, run_dir: Path, steps: int) -> dict:
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
        "train.seed=0",
    ]
    env = {**os.environ, "PYTHONPATH": source_path(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    trace, to_launch = run_dir / "trace.jsonl", None
    while proc.poll() is None and to_launch is None:
        if trace.exists() and b'"ev":"launch"' in trace.read_bytes():
            to_launch = time.monotonic() - t0
        else:
            time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=1800)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: gyre demo failed:\n{stderr[-3000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"to_launch_s": to_launch, "wall_s": wall, "cpu_s": cpu, "steps": summary["steps"]}


def stats(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 4; 2 with --quick)")
    parser.add_argument("--baseline", default="HEAD", help="the commit to compare against (default HEAD)")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 4)
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.baseline], cwd=ROOT, check=True, text=True, capture_output=True
    ).stdout.strip()
    runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
    with tempfile.TemporaryDirectory(prefix="gyre-startup-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), rev], cwd=ROOT, check=True)
        try:
            compile_tree(base)
            compile_tree(ROOT)
            for r in range(repeats):
                for name, tree in (("baseline", base), ("candidate", ROOT)):
                    res = run_once(tree, Path(tmp) / f"{name}-{r}", args.steps)
                    runs[name].append(res)
                    print(
                        f"{name} #{r}: {json.dumps({k: round(v, 2) for k, v in res.items()})}",
                        file=sys.stderr,
                    )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)

    out: dict = {
        "bench": "run_startup",
        "baseline": rev,
        "steps": args.steps,
        "repeats": repeats,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for key in ("to_launch_s", "wall_s", "cpu_s"):
        base_v, cand_v = ([x[key] for x in runs[n]] for n in ("baseline", "candidate"))
        out[key] = {
            "baseline": stats(base_v),
            "candidate": stats(cand_v),
            "ratio": round(statistics.median(cand_v) / statistics.median(base_v), 3),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
