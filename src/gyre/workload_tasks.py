"""A `gyre run` that plays a workload definition (`gyre_sched.config.WorkloadConfig`, seeded), the same one the
simulator runs: one task whose harness is `gyre_sched.workload_harness` and whose scoring is
`gyre_eval.workload.WorkloadEvaluator`, with the workload's harness timeout and overall budget.

    task_file, sets = workload_run_files(workload, seed, folder)
    gyre demo --set tasks.file=... (and every `sets` entry)

The task file names this interpreter: the harness runs in the run's own environment.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gyre_sched import workload_harness
from gyre_sched.config import WorkloadConfig

__all__ = ["workload_run_files"]

PROMPT = "Work on the repository until the task is done."


def workload_run_files(workload: WorkloadConfig, seed: int, folder: Path) -> tuple[Path, list[str]]:
    """Write `folder/workload.json` and `folder/tasks.jsonl`; returns the task file and the `--set` overrides a run
    needs to play the workload (its task file, and the stall watchdog where hangs become known by stalling)."""
    folder.mkdir(parents=True, exist_ok=True)
    definition = folder / "workload.json"
    definition.write_text(workload.model_dump_json(indent=1))
    harness = [
        sys.executable,
        "-I",  # the script's own folder (gyre_sched's modules) stays off sys.path
        workload_harness.__file__,
        "--workload",
        str(definition),
        "--seed",
        str(seed),
        "--task",
        "{task}",
    ]
    task = {
        "query_id": "workload",
        "prompt": PROMPT,
        "workspace": {"empty": True},
        "harness": {"kind": "command", "command": harness},
        "scoring": {
            "kind": "python",
            "factory": "gyre_eval.workload:WorkloadEvaluator",
            "options": {"workload": str(definition), "seed": seed},
        },
        "harness_timeout_s": workload.harness_timeout_s,
        "overall_budget_s": workload.overall_budget_s,
    }
    tasks = folder / "tasks.jsonl"
    tasks.write_text(json.dumps(task) + "\n")
    os.chmod(folder, 0o755)  # a sandboxed harness (another uid) reads the definition
    sets = [f"tasks.file={tasks}"]
    if workload.exclusion_known == "stall" and workload.overall_timeout_rate > 0:
        sets.append(f"agent.stall_detect_s={workload.stall_detect_s}")
    return tasks, sets
